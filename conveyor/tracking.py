"""Experiment trackers: TensorBoard, MLflow and Weights & Biases behind one interface.

The learner and ``conveyor eval`` log through a :class:`Tracker`: the run's config, every
step's scalars (the same values as ``metrics.jsonl``), eval results and where the final model
is. A tracker never blocks or stops a step: records go through a bounded queue to one
background thread that calls the backend; a backend that fails is logged and counted
(``failures``; ``conveyor_tracker_failures_total`` where the process serves metrics), and
when the queue is full new records are dropped and counted (``dropped``).

Each backend uses its library's own writer: ``torch.utils.tensorboard.SummaryWriter``,
``mlflow.tracking.MlflowClient``, ``wandb.init``. The libraries are imported when a backend
starts, so a role that tracks nothing needs none of them.
"""

from __future__ import annotations

import json
import math
import os
import queue
import re
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import structlog

from conveyor.observability_config import TrackingConfig

log = structlog.get_logger(__name__)


class Backend(Protocol):
    def start(self, name: str, config: Mapping[str, Any]) -> None: ...
    def scalars(self, step: int, values: Mapping[str, float], prefix: str) -> None: ...
    def model(self, location: str) -> None: ...
    def close(self) -> None: ...


def flat(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested config as ``a.b.c -> value`` strings (MLflow params, TensorBoard's config text)."""
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flat(value, f"{name}."))
        else:
            out[name] = json.dumps(value, default=str) if not isinstance(value, str) else value
    return out


def numeric(values: Mapping[str, Any]) -> dict[str, float]:
    """The finite numbers of a row (a step's row also carries lists, dicts and None)."""
    return {
        k: float(v)
        for k, v in values.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))
    }


class TensorBoardBackend:
    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.writer: Any = None

    def start(self, name: str, config: Mapping[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(self.log_dir / name))
        text = "\n".join(f"    {k}: {v}" for k, v in sorted(flat(config).items()))  # indented: Markdown code
        self.writer.add_text("config", text, 0)

    def scalars(self, step: int, values: Mapping[str, float], prefix: str) -> None:
        for key, value in values.items():
            self.writer.add_scalar(f"{prefix}{key}", value, step)
        self.writer.flush()

    def model(self, location: str) -> None:
        self.writer.add_text("model", location, 0)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class MlflowBackend:
    MAX_PARAM = 6000  # MLflow's limit on a param value's length

    def __init__(self, uri: str, experiment: str) -> None:
        self.uri, self.experiment = uri, experiment
        self.client: Any = None
        self.run_id = ""

    def start(self, name: str, config: Mapping[str, Any]) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=self.uri)
        found = self.client.get_experiment_by_name(self.experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(self.experiment)
        # A learner restarted after a crash logs on into the run its predecessor left RUNNING (which
        # would otherwise stay RUNNING for good), as it resumes the same training run.
        quoted = name.replace("'", "\\'")
        left = self.client.search_runs([experiment_id], f"tags.`conveyor.run_id` = '{quoted}' and attributes.status = 'RUNNING'",
                                       order_by=["attributes.start_time DESC"], max_results=1)  # fmt: skip
        if left:
            self.run_id, logged = left[0].info.run_id, left[0].data.params
        else:
            self.run_id = self.client.create_run(experiment_id, run_name=name, tags={"conveyor.run_id": name}).info.run_id
            logged = {}
        # MLflow refuses to change a logged param: a resumed run keeps its first values.
        params = [Param(k, v[: self.MAX_PARAM]) for k, v in flat(config).items() if k not in logged]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[i : i + 100])

    def scalars(self, step: int, values: Mapping[str, float], prefix: str) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(f"{prefix}{k}".replace("/", "."), v, now, step) for k, v in values.items()]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])

    def model(self, location: str) -> None:
        self.client.set_tag(self.run_id, "conveyor.model", location)

    def close(self) -> None:
        if self.client is not None and self.run_id:
            self.client.set_terminated(self.run_id)


class WandbBackend:
    def __init__(self, run_dir: Path, project: str, mode: str | None) -> None:
        self.run_dir, self.project, self.mode = run_dir, project, mode
        self.run: Any = None

    def start(self, name: str, config: Mapping[str, Any]) -> None:
        import wandb

        self.run_dir.mkdir(parents=True, exist_ok=True)
        mode: Any = self.mode or os.environ.get("WANDB_MODE") or "online"  # W&B checks the value
        # The run's id is its name: a learner restarted from a checkpoint logs on into the same W&B run.
        run_id = re.sub(r"[^A-Za-z0-9_-]", "-", name)[:64]
        self.run = wandb.init(project=self.project, name=name, id=run_id, resume="allow", dir=str(self.run_dir),
                              config=dict(config), mode=mode, reinit="create_new")  # fmt: skip

    def scalars(self, step: int, values: Mapping[str, float], prefix: str) -> None:
        self.run.log({f"{prefix}{k}": v for k, v in values.items()}, step=step)

    def model(self, location: str) -> None:
        self.run.summary["model"] = location

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()


_STOP = object()


class Tracker:
    """One run in one backend, fed from any thread without waiting on it."""

    def __init__(self, backend: Backend, max_pending: int = 10_000) -> None:
        self.backend = backend
        self.failures = 0
        self.dropped = 0
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self._thread = threading.Thread(target=self._work, name="tracker", daemon=True)
        self._started = False
        self._last_step = -1  # W&B refuses a step lower than one it has seen: eval rows reuse the last

    def start(self, name: str, config: Mapping[str, Any]) -> None:
        self._thread.start()
        self._started = True
        self._put(self.backend.start, name, config)

    def log(self, step: int, row: Mapping[str, Any], prefix: str = "") -> None:
        """The numeric values of ``row`` at ``step`` (others are left out)."""
        values = numeric(row)
        if values:
            self._last_step = max(self._last_step, step)
            self._put(self.backend.scalars, step, values, prefix)

    def log_eval(self, results: Mapping[str, Any], step: int | None = None) -> None:
        self.log(self._last_step if step is None else step, results, prefix="eval/")

    def log_model(self, location: str) -> None:
        self._put(self.backend.model, location)

    def close(self, timeout_s: float = 60.0) -> None:
        """Flush what is queued (up to ``timeout_s``) and end the backend's run."""
        if not self._started:
            return
        try:  # waits for room (unlike a record): the backend's run must end
            self._queue.put((self.backend.close, ()), timeout=timeout_s)
            self._queue.put(_STOP, timeout=timeout_s)
        except queue.Full:
            pass
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("tracker.close_timed_out", pending=self._queue.qsize(), seconds=timeout_s)

    def _put(self, fn, *args) -> None:
        try:
            self._queue.put_nowait((fn, args))
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log.warning("tracker.dropped", dropped=self.dropped, pending=self._queue.maxsize)

    def _work(self) -> None:
        broken = False  # a backend whose start failed takes nothing more (each call would fail too)
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            fn, args = item
            if broken:
                self._failed(fn, "the tracker did not start")
                continue
            try:
                fn(*args)
            except Exception as exc:  # noqa: BLE001 - a tracker never stops the run
                broken = fn == self.backend.start
                self._failed(fn, f"{type(exc).__name__}: {exc}"[:500])

    def _failed(self, fn, error: str) -> None:
        self.failures += 1
        if self.failures <= 3 or self.failures % 100 == 0:
            log.warning("tracker.failed", call=getattr(fn, "__name__", "?"), failures=self.failures, error=error)
        from conveyor.metrics import process_tracker_failures

        counter = process_tracker_failures()
        if counter is not None:
            counter.inc()


def open_tracker(cfg: TrackingConfig, run_dir: Path, name: str, config: Mapping[str, Any]) -> Tracker | None:
    """The tracker the config asks for (None for ``type: none``), started as run ``name`` with
    ``config`` logged; files under ``run_dir`` unless the config names a directory or URI."""
    base = Path(cfg.dir) if cfg.dir else Path(run_dir)
    backend: Backend
    if cfg.type == "none":
        return None
    if cfg.type == "tensorboard":
        backend = TensorBoardBackend(base / "tensorboard")
    elif cfg.type == "mlflow":
        uri = cfg.uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(Path(run_dir) / 'mlflow.db').resolve()}"
        backend = MlflowBackend(uri, cfg.project)
    else:
        backend = WandbBackend(base, cfg.project, cfg.wandb_mode)
    tracker = Tracker(backend, cfg.max_pending)
    tracker.start(name, config)
    return tracker
