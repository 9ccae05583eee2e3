"""The demo sandbox: each claimed property, tested from the outside.

(The full adversarial suite, seccomp and cgroup limits are issue #4.)"""

from __future__ import annotations

import os
import subprocess

import pytest

from conftest import service_unavailable


@pytest.fixture(scope="module")
def sandbox():
    from reward.sandbox import PythonSandbox, SandboxUnavailable

    try:
        return PythonSandbox(timeout_s=1.0, memory_mb=128, max_output_bytes=2048)
    except SandboxUnavailable as exc:
        service_unavailable(f"bubblewrap sandbox: {exc}")


CASES = {
    "pass": ("x = 2 + 3\nassert x == 5\n", "pass"),
    "assert": ("assert 1 == 2\n", "fail"),
    "syntax": ("x = (\n", "error"),
    "infinite loop": ("while True:\n    pass\n", "timeout"),
    "memory bomb": ("a = bytearray(10**9)\n", "memory"),
    "huge output": ("print('y' * 10**6)\n", "output_limit"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_verdicts(sandbox, name):
    src, verdict = CASES[name]
    [result] = sandbox.run_batch([src])
    assert result.verdict == verdict, result


def test_feedback_names_the_exception_and_line(sandbox):
    [r] = sandbox.run_batch(["x = 1\ny = [][3]\n"])
    assert r.verdict == "error"
    assert r.feedback["type"] == "IndexError" and r.feedback["line"] == 2


def test_no_network_not_even_loopback(sandbox):
    [tcp, udp] = sandbox.run_batch(
        [
            "import socket\nsocket.create_connection(('127.0.0.1', 6379), timeout=0.5)\n",
            "import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\ns.sendto(b'x', ('8.8.8.8', 53))\n",
        ]
    )
    assert tcp.verdict == "error" and tcp.feedback["type"] in ("ConnectionRefusedError", "OSError", "TimeoutError")
    assert udp.verdict == "error"


def test_host_files_are_invisible(sandbox):
    project = os.path.abspath(__file__)
    results = sandbox.run_batch([f"open({p!r}).read()\n" for p in ("/etc/shadow", "/etc/passwd", project, "/root/.bashrc")])
    assert all(r.verdict == "error" and r.feedback["type"] in ("FileNotFoundError", "PermissionError") for r in results)


def test_runs_as_nobody_without_capabilities(sandbox):
    [r] = sandbox.run_batch(["import os\nprint(os.getuid(), os.getgid())\nos.setuid(0)\n"])
    assert r.stdout.split() == ["65534", "65534"]
    assert r.verdict == "error" and r.feedback["type"] in ("PermissionError", "OSError")  # EPERM / EINVAL in the userns


def test_cannot_write_outside_the_work_directory(sandbox):
    [r] = sandbox.run_batch(["open('/usr/evil', 'w')\n"])
    assert r.verdict == "error" and r.feedback["type"] in ("OSError", "PermissionError")


def test_environment_is_not_passed_in(sandbox, monkeypatch):
    monkeypatch.setenv("CONVEYOR_SECRET", "hunter2")
    [r] = sandbox.run_batch(["import os\nprint(sorted(os.environ))\n"])
    assert "CONVEYOR_SECRET" not in r.stdout and "hunter2" not in r.stdout


def test_no_process_survives_a_batch(sandbox):
    marker = "conveyor-daemon-marker"
    sandbox.run_batch([f"import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)  # {marker}\n"])
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert "/harness.py" not in ps


def test_identical_programs_run_once_and_results_keep_order(sandbox):
    progs = ["print(1)\n", "print(2)\n", "print(1)\n"]
    results = sandbox.run_batch(progs)
    assert [r.stdout.strip() for r in results] == ["1", "2", "1"]
