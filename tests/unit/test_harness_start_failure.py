"""A job whose supervisor cannot be started (``clone`` refused: EAGAIN at the pids limit, say)
gets an ``infra`` verdict of its own; the batch's other jobs still run, a supervisor found dead
between two jobs is replaced, and the harness (a long-lived fork server in warm mode) leaks no
file descriptor. The harness is imported as a module here; ``_start_supervisor`` is replaced by
a plain fork that serves the slot's socket with the harness's own protocol and reports exit
status 0 for every job, or by an error, so no namespace is needed."""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import socket
from pathlib import Path

HARNESS = Path(__file__).resolve().parents[2] / "sandbox" / "harness.py"
LIMITS = {"timeout_s": 5.0, "max_output_bytes": 4096}


def _harness():
    spec = importlib.util.spec_from_file_location("harness_under_test", HARNESS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _fake_supervisors(h, refuse=(), die_after=None):
    """Stand-ins for ``_start_supervisor``: the n-th start (1-based) in ``refuse`` fails; a started
    one serves jobs (stdout: the job's source), exiting after ``die_after`` jobs if given."""
    starts = []

    def start(ctl_fd, bpf):
        starts.append(ctl_fd)
        if len(starts) in refuse:
            raise OSError(errno.EAGAIN, "clone: Resource temporarily unavailable")
        pid = os.fork()
        if pid == 0:
            try:
                h.close_fds_except({0, 1, 2, ctl_fd})
                sock = socket.socket(fileno=ctl_fd)
                served = 0
                while served != die_after:
                    got = h._receive(sock)
                    if got is None:
                        break
                    job, _, (out_w, err_w, rep_w, status_w) = got
                    if served + 1 == die_after:
                        sock.close()  # gone before its last job's status: the next send finds it dead
                    os.write(out_w, job["source"].encode())
                    os.write(status_w, json.dumps({"status": 0, "maxrss_kb": 1024}).encode())
                    for fd in (out_w, err_w, rep_w, status_w):
                        os.close(fd)
                    served += 1
            finally:
                os._exit(0)
        return pid

    return start, starts


def test_a_job_whose_supervisor_cannot_start_is_infra_and_the_others_run(monkeypatch):
    h = _harness()
    start, starts = _fake_supervisors(h, refuse={2})
    monkeypatch.setattr(h, "_start_supervisor", start)
    jobs = [{"kind": "python", "source": s} for s in "abcde"]
    before = _open_fds()
    results = h.run_all(jobs, LIMITS, b"", 2)
    h.close_slots()
    assert _open_fds() == before
    assert [r["verdict"] for r in results] == ["pass", "infra", "pass", "pass", "pass"]
    assert [r["stdout"] for r in results] == ["a", "", "c", "d", "e"]
    assert "could not start the job" in results[1]["stderr"] and "Resource temporarily unavailable" in results[1]["stderr"]
    assert len(starts) == 3  # two slots serve the batch; the refused one was started again for the next job


def test_a_supervisor_that_died_between_jobs_is_replaced(monkeypatch):
    h = _harness()
    start, starts = _fake_supervisors(h, die_after=1)
    monkeypatch.setattr(h, "_start_supervisor", start)
    before = _open_fds()
    results = h.run_all([{"kind": "python", "source": s} for s in "abc"], LIMITS, b"", 1)
    h.close_slots()
    assert _open_fds() == before
    assert [r["verdict"] for r in results] == ["pass"] * 3 and [r["stdout"] for r in results] == ["a", "b", "c"]
    assert len(starts) == 3


def test_a_batch_where_nothing_starts_returns_and_leaks_nothing(monkeypatch):
    h = _harness()
    start, _ = _fake_supervisors(h, refuse=set(range(1, 100)))
    monkeypatch.setattr(h, "_start_supervisor", start)
    before = _open_fds()
    results = h.run_all([{"kind": "python", "source": "x"}] * 4, LIMITS, b"", 2)
    h.close_slots()
    assert _open_fds() == before
    assert [r["verdict"] for r in results] == ["infra"] * 4
