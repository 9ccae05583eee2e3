"""A Prometheus server scraping a local run: the dashboards' and alert rules' real evaluator.

The binary is Debian's ``prometheus`` package (``install.sh`` installs it where it may; PyPI
carries no Prometheus server), or ``CONVEYOR_PROMETHEUS_BIN``. The server scrapes each role's
``/metrics`` with a ``role`` label, as the chart's PodMonitor and scrape config do in a
cluster, so the dashboard's queries and the alert rules run unchanged against it.
"""

from __future__ import annotations

import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

from conveyor.binaries import prometheus_binary
from launch.stack.ready import NotReady, wait_http_ready

JOB = "conveyor"


def scrape_config(targets: Mapping[str, int], interval_s: float, labels: Mapping[str, str] | None = None,
                  host: str = "127.0.0.1") -> dict:  # fmt: skip
    """One job; each role's target carries the ``role`` label (role name -> metrics port), as the
    chart's PodMonitor gives it, and ``labels`` (the chart's rules select ``namespace`` and ``release``)."""
    return {
        "job_name": JOB,
        "scrape_interval": f"{interval_s:g}s",
        "scrape_timeout": f"{min(interval_s, 10):g}s",
        "static_configs": [{"targets": [f"{host}:{port}"],
                            "labels": {**(labels or {}), "role": _role_kind(name), "instance_name": name}}
                           for name, port in targets.items()],
    }  # fmt: skip


def _role_kind(name: str) -> str:
    """``rollout-worker-1`` -> ``rollout-worker``: the chart's component label, one per kind."""
    head, _, tail = name.rpartition("-")
    return head if tail.isdigit() else name


@dataclass
class Prometheus:
    """A Prometheus server on ``port`` keeping its data under ``data_dir``."""

    data_dir: Path
    port: int
    targets: dict[str, int]
    rule_files: Sequence[Path] = ()
    labels: Mapping[str, str] = field(default_factory=dict)  # on every target
    interval_s: float = 1.0
    proc: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, ready_within_s: float = 60.0) -> Prometheus:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        config = {
            "global": {"scrape_interval": f"{self.interval_s:g}s", "evaluation_interval": f"{self.interval_s:g}s"},
            "rule_files": [str(p) for p in self.rule_files],
            "scrape_configs": [scrape_config(self.targets, self.interval_s, self.labels)],
        }
        config_path = self.data_dir / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        log = (self.data_dir / "prometheus.log").open("ab")
        self.proc = subprocess.Popen(
            [str(prometheus_binary()), f"--config.file={config_path}", f"--storage.tsdb.path={self.data_dir / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1d"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        try:
            wait_http_ready(self.proc, f"{self.url}/-/ready", ready_within_s, name="prometheus", log_tail=self.log_tail)
        except NotReady:
            self.stop()
            raise
        return self

    def log_tail(self, chars: int = 2000) -> str:
        path = self.data_dir / "prometheus.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    def _get(self, path: str, **params) -> dict:
        body = httpx.get(f"{self.url}{path}", params=params, timeout=30).json()
        if body.get("status") != "success":
            raise RuntimeError(f"prometheus {path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        """An instant query's series (``at``: a Unix time; None: now)."""
        params = {"query": expr} if at is None else {"query": expr, "time": f"{at:.3f}"}
        return self._get("/api/v1/query", **params)["result"]

    def rules(self) -> list[dict]:
        """The loaded rule groups, with each rule's health and last error."""
        return self._get("/api/v1/rules")["groups"]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
