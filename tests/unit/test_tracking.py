"""Experiment trackers, each read back with its own tool: TensorBoard's event reader, MLflow's
client on a local SQLite store, and W&B's offline run file. A tracker never blocks or stops the
caller: a failing backend is counted, a slow one makes records drop (counted), not wait."""

from __future__ import annotations

import json
import struct
import threading
import time

import pytest

from conveyor.observability_config import TrackingConfig
from conveyor.tracking import Tracker, open_tracker

pytestmark = pytest.mark.unit

CONFIG = {"run_id": "exp-1", "learner": {"lr": 0.001, "batch_groups": 8}, "object_store": {"secret_access_key": "**********"}}
ROWS = [{"step": s, "loss": 1.0 / s, "reward_mean": 0.1 * s, "staleness": {"0": 4}, "kl": None} for s in (1, 2, 3)]
EVAL = {"pass_at_1": 0.75, "mean_tokens": 12.5, "tasks": 40}


def _track(cfg: TrackingConfig, run_dir) -> Tracker:
    tracker = open_tracker(cfg, run_dir, "exp-1", CONFIG)
    assert tracker is not None
    for row in ROWS:
        tracker.log(row["step"], row)
    tracker.log_eval(EVAL)
    tracker.log_model("s3://bucket/runs/exp-1/weights/v3/model.safetensors")
    tracker.close()
    assert tracker.failures == 0 and tracker.dropped == 0
    return tracker


def test_tensorboard_event_files_read_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _track(TrackingConfig(type="tensorboard"), tmp_path)
    events = EventAccumulator(str(tmp_path / "tensorboard" / "exp-1"), size_guidance={"tensors": 0})
    events.Reload()
    # torch's SummaryWriter writes scalars as scalar events and text as tensor events.
    loss = [(e.step, e.value) for e in events.Scalars("loss")]
    assert loss == [(1, 1.0), (2, 0.5), (3, pytest.approx(1 / 3))]
    assert [e.step for e in events.Scalars("step")] == [1, 2, 3]  # every numeric column, none of the others
    assert "staleness" not in events.Tags()["scalars"] and "kl" not in events.Tags()["scalars"]
    assert [(e.step, e.value) for e in events.Scalars("eval/pass_at_1")] == [(3, 0.75)]  # at the last step logged
    texts = {
        tag: events.Tensors(tag)[0].tensor_proto.string_val[0].decode() for tag in ("config/text_summary", "model/text_summary")
    }
    assert "learner.lr: 0.001" in texts["config/text_summary"] and texts["model/text_summary"].startswith("s3://bucket/")


def test_mlflow_runs_read_back_with_the_client(tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    _track(TrackingConfig(type="mlflow", uri=uri, project="my-experiment"), tmp_path)
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("my-experiment").experiment_id])
    assert run.info.run_name == "exp-1" and run.info.status == "FINISHED"
    assert run.data.params["learner.lr"] == "0.001" and run.data.params["object_store.secret_access_key"] == "**********"
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "reward_mean")] == [
        (1, pytest.approx(0.1)), (2, pytest.approx(0.2)), (3, pytest.approx(0.3))]  # fmt: skip
    assert run.data.metrics["eval.pass_at_1"] == 0.75
    assert run.data.tags["conveyor.model"] == "s3://bucket/runs/exp-1/weights/v3/model.safetensors"


def test_a_learner_restarted_after_a_crash_finishes_the_mlflow_run_it_left_running(tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = TrackingConfig(type="mlflow", uri=uri, project="crashes")
    crashed = open_tracker(cfg, tmp_path, "exp-1", CONFIG)
    for row in ROWS[:2]:
        crashed.log(row["step"], row)
    crashed.close()  # its records are in; then the process dies without ending the run:
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("crashes").experiment_id
    (run,) = client.search_runs([experiment])
    client.update_run(run.info.run_id, status="RUNNING")  # what a SIGKILL before set_terminated leaves
    restarted = open_tracker(cfg, tmp_path, "exp-1", {**CONFIG, "learner": {"lr": 0.002, "batch_groups": 8}})
    for row in ROWS[1:]:  # re-trains the step after its checkpoint
        restarted.log(row["step"], row)
    restarted.close()
    assert restarted.failures == 0
    (run,) = client.search_runs([experiment])  # one run, not a second beside a RUNNING one
    assert run.info.status == "FINISHED" and run.data.params["learner.lr"] == "0.001"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [1, 2, 2, 3]


def wandb_records(path):
    """The records of a W&B run file: a LevelDB-style log of protobuf ``Record`` messages (wandb's
    own Python reader is gone from the package; its writer is the Go core)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block = path.read_bytes(), 32 * 1024
    assert data[:4] == b":W&B"
    pos, buf, out = 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 2):  # full, first
            buf = chunk
        else:  # middle, last
            buf += chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(buf)
            out.append(record)
    return out


def test_wandb_offline_run_files_hold_the_run(tmp_path):
    _track(TrackingConfig(type="wandb", wandb_mode="offline", project="p"), tmp_path)
    (path,) = (tmp_path / "wandb").glob("offline-run-*/run-exp-1.wandb")
    # W&B's own process writes the file; on a busy machine it may still be flushing after finish().
    for _ in range(100):
        records = wandb_records(path)
        runs = [r.run for r in records if r.WhichOneof("record_type") == "run"]
        if runs and any(r.WhichOneof("record_type") == "history" for r in records):
            break
        time.sleep(0.2)
    (run,) = runs
    assert run.project == "p" and run.display_name == "exp-1" and run.run_id == "exp-1"
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["learner"] == {"lr": 0.001, "batch_groups": 8}
    key = lambda item: item.key or "/".join(item.nested_key)  # noqa: E731 - W&B writes either
    history = [
        {key(i): json.loads(i.value_json) for i in r.history.item} for r in records if r.WhichOneof("record_type") == "history"
    ]
    assert [(h["_step"], h["loss"]) for h in history if "loss" in h] == [(1, 1.0), (2, 0.5), (3, pytest.approx(1 / 3))]
    assert [(h["_step"], h["eval/pass_at_1"]) for h in history if "eval/pass_at_1" in h] == [(3, 0.75)]
    summary = {
        key(i): json.loads(i.value_json) for r in records if r.WhichOneof("record_type") == "summary" for i in r.summary.update
    }
    assert summary["model"] == "s3://bucket/runs/exp-1/weights/v3/model.safetensors"


class Failing:
    def __init__(self) -> None:
        self.calls = 0
        self.closed = False

    def start(self, name, config):
        pass

    def scalars(self, step, values, prefix):
        self.calls += 1
        raise ConnectionError("tracking server unreachable")

    def model(self, location):
        pass

    def close(self):
        self.closed = True


class Slow(Failing):
    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def scalars(self, step, values, prefix):
        self.release.wait(10)
        self.calls += 1


def test_a_failing_tracker_is_counted_and_the_caller_goes_on():
    backend = Failing()
    tracker = Tracker(backend)
    tracker.start("r", {})
    for row in ROWS:
        tracker.log(row["step"], row)
    tracker.close()
    assert backend.calls == 3 and tracker.failures == 3


def test_a_tracker_that_cannot_start_takes_nothing_more():
    class NoStart(Failing):
        def start(self, name, config):
            raise PermissionError("no credentials")

    backend = NoStart()
    tracker = Tracker(backend)
    tracker.start("r", {})
    tracker.log(1, {"loss": 1.0})
    tracker.close()
    assert backend.calls == 0 and tracker.failures == 3  # start, then each call refused without trying


def test_a_slow_tracker_never_makes_the_caller_wait():
    backend = Slow()
    tracker = Tracker(backend, max_pending=5)
    tracker.start("r", {})
    for step in range(1, 101):
        tracker.log(step, {"loss": 1.0})
    assert backend.calls == 0  # the backend holds its first call until released: the caller waited on none
    backend.release.set()
    tracker.close()
    assert backend.closed and tracker.dropped >= 90 and backend.calls == 100 - tracker.dropped


def test_none_is_no_tracker(tmp_path):
    assert open_tracker(TrackingConfig(), tmp_path, "r", {}) is None
