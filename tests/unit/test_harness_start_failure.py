"""A job whose process cannot be started (``clone`` refused: EAGAIN at the pids limit, say)
gets an ``infra`` verdict of its own; the batch's other jobs still run, and the harness (a
long-lived fork server in warm mode) leaks no file descriptor. The harness is imported as a
module here; ``_clone_supervisor`` is replaced by a plain fork that reports success, or by
an error, so no namespace is needed."""

from __future__ import annotations

import errno
import importlib.util
import json
import os
from pathlib import Path

HARNESS = Path(__file__).resolve().parents[2] / "reward" / "harness.py"
LIMITS = {"timeout_s": 5.0, "max_output_bytes": 4096}


def _harness():
    spec = importlib.util.spec_from_file_location("harness_under_test", HARNESS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_job_that_cannot_start_is_infra_and_the_others_run(monkeypatch):
    h = _harness()
    started = []

    def clone(job, lim, bpf, pipes):
        if job["source"] == "refused":
            raise OSError(errno.EAGAIN, "clone: Resource temporarily unavailable")
        pid = os.fork()
        if pid == 0:  # stands in for the supervisor: reports exit status 0
            os.write(pipes[3][1], json.dumps({"status": 0, "maxrss_kb": 1024}).encode())
            os._exit(0)
        started.append(job["source"])
        return pid

    monkeypatch.setattr(h, "SYS_CLONE", 56)
    monkeypatch.setattr(h, "_clone_supervisor", clone)
    jobs = [{"kind": "python", "source": s} for s in ("a", "refused", "b", "refused", "c")]
    before = _open_fds()
    results = h.run_all(jobs, LIMITS, b"", 2)
    assert _open_fds() == before
    assert [r["verdict"] for r in results] == ["pass", "infra", "pass", "infra", "pass"]
    assert started == ["a", "b", "c"]
    assert "could not start the job" in results[1]["stderr"] and "Resource temporarily unavailable" in results[1]["stderr"]


def test_a_batch_where_nothing_starts_returns_and_leaks_nothing(monkeypatch):
    h = _harness()

    def clone(job, lim, bpf, pipes):
        raise OSError(errno.EAGAIN, "clone: Resource temporarily unavailable")

    monkeypatch.setattr(h, "SYS_CLONE", 56)
    monkeypatch.setattr(h, "_clone_supervisor", clone)
    before = _open_fds()
    results = h.run_all([{"kind": "python", "source": "x"}] * 4, LIMITS, b"", 2)
    assert _open_fds() == before
    assert [r["verdict"] for r in results] == ["infra"] * 4
