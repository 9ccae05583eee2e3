"""The sandbox's claims, one test each, attacked from inside.

Every test also checks that the host is unaffected afterwards: no process
of the sandbox left, no mount added, no cgroup left (the ``host_unaffected``
fixture).
"""

from __future__ import annotations

import glob
import subprocess
import time

import pytest
from conftest import ROOT, open_sandbox


@pytest.fixture(scope="module", params=["cold", "warm", "relay"])
def sandbox(request, tmp_path_factory):
    """Every claim holds for a launch per batch (cold), for a long-lived sandbox (warm), and for
    the harness's fallback on machines without a known ``clone`` number (relay: a process that
    unshares, then forks the job's supervisor)."""
    with pytest.MonkeyPatch.context() as mp:
        if request.param == "relay":
            import sandbox.runner

            harness = tmp_path_factory.mktemp("relay") / "harness.py"
            source = sandbox.runner.HARNESS.read_text()
            assert "\nSYS_CLONE = " in source
            harness.write_text(source.replace("\nSYS_CLONE = ", "\nSYS_CLONE = None  # ", 1))
            mp.setattr(sandbox.runner, "HARNESS", harness)
        sb = open_sandbox(timeout_s=1.5, memory_mb=128, max_output_bytes=2048, tmp_mb=8, nproc=32, file_mb=2,
                          parallel=2, warm=request.param == "warm")  # fmt: skip
        yield sb
        sb.close()


def _host_state():
    """This process's share of the host: the suite runs on parallel workers, each with sandboxes
    of its own. A sandbox process counts if it has lost its parent (one that escaped would be
    reparented; whose it was cannot be told, so every test sees it; a warm sandbox's own servers,
    which it restarts after a kill, do not count); a cgroup counts if its owner (the pid in its
    name) is this process, a descendant, or gone."""
    import psutil

    me = psutil.Process()
    mine = {me.pid} | {c.pid for c in me.children(recursive=True)}
    procs = []
    for proc in psutil.process_iter(["cmdline", "ppid"]):
        args = " ".join(proc.info["cmdline"] or [])
        if ("/harness.py" in args or "conveyor-marker" in args) and proc.info["ppid"] == 1:
            procs.append(args)
    with open("/proc/self/mountinfo") as fh:
        mounts = len(fh.read().splitlines())
    cgroups = []
    for path in glob.glob("/sys/fs/cgroup/**/conveyor-sbx-*", recursive=True):
        owner = int(path.rsplit("conveyor-sbx-", 1)[1].split("-")[0])
        if owner in mine or not psutil.pid_exists(owner):
            cgroups.append(path)
    return sorted(procs), mounts, sorted(cgroups)


@pytest.fixture(autouse=True)
def host_unaffected(sandbox):  # after the sandbox is up; before it is closed
    before = _host_state()
    yield
    for _ in range(100):  # a killed tree takes a moment to be reaped (longer beside other workers' tests)
        after = _host_state()
        if after == before:
            break
        time.sleep(0.1)
    assert after == before, f"host changed: {before} -> {after}"


def run1(sandbox, src, **kw):
    from sandbox.runner import Job

    [r] = sandbox.run([Job(src, **kw)])
    return r


def test_fork_bomb_is_contained(sandbox):
    r = run1(sandbox, "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n")
    assert r.verdict == "timeout"
    assert r.duration_s < 5


def test_memory_bomb_is_killed_with_memory_verdict(sandbox):
    r = run1(sandbox, "blocks = []\nwhile True:\n    blocks.append(bytearray(16 << 20))\n")
    assert r.verdict == "memory"


def test_disk_fill_stops_at_the_tmpfs_limit(sandbox):
    src = "import os\nfor i in range(1000):\n    with open(f'f{i}', 'wb') as fh:\n        fh.write(b'x' * (1 << 20))\n"
    r = run1(sandbox, src)
    assert r.verdict == "error"
    assert r.feedback["type"] == "OSError" and "No space left" in r.feedback["message"]


def test_huge_output_is_capped(sandbox):
    r = run1(sandbox, "import sys\nwhile True:\n    sys.stdout.write('y' * 65536)\n")
    assert r.verdict == "output_limit"
    assert len(r.stdout) <= 2048


def test_infinite_loop_times_out(sandbox):
    r = run1(sandbox, "while True:\n    pass\n")
    assert r.verdict == "timeout" and r.duration_s < 3


def test_sleeping_daemon_does_not_outlive_its_job(sandbox):
    src = (
        "import os, subprocess\n"
        "subprocess.Popen(['/bin/sleep', '61.4242'], start_new_session=True)\n"  # conveyor-marker via args
        "if os.fork() == 0:\n    os.setsid()\n    os.execv('/bin/sleep', ['sleep', '61.4243'])\n"
        "print('left them behind')\n"
    )
    r = run1(sandbox, src)
    assert r.verdict == "pass"
    time.sleep(0.3)
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert "61.424" not in ps


@pytest.mark.parametrize(
    "src",
    [
        "import socket\nsocket.create_connection(('127.0.0.1', 6379), timeout=0.5)\n",
        "import socket\nsocket.create_connection(('1.1.1.1', 443), timeout=0.5)\n",
        "import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\ns.sendto(b'x', ('127.0.0.1', 53))\n",
        "import socket\ns = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)\ns.sendto(b'x', ('::1', 53))\n",
        "import socket\nsocket.socket(socket.AF_PACKET, socket.SOCK_RAW)\n",
    ],
    ids=["tcp-loopback", "tcp-outside", "udp-loopback", "udp6-loopback", "raw-packet"],
)
def test_no_network(sandbox, src):
    r = run1(sandbox, src)
    assert r.verdict == "error" and r.feedback["type"] == "PermissionError", r


def test_unix_sockets_still_work(sandbox):
    r = run1(sandbox, "import socket\na, b = socket.socketpair()\na.send(b'hi')\nassert b.recv(2) == b'hi'\n")
    assert r.verdict == "pass", r


@pytest.mark.parametrize("path", ["/etc/shadow", "/etc/passwd", "/root/.bashrc", str(ROOT / "pyproject.toml"), "/proc/1/environ"])
def test_host_files_are_invisible(sandbox, path):
    r = run1(sandbox, f"print(open({path!r}).read()[:50])\n")
    assert r.verdict == "error" and r.feedback["type"] in ("FileNotFoundError", "PermissionError"), r


def test_another_jobs_files_are_invisible(sandbox):
    from sandbox.runner import Job

    writer = "import time\nopen('secret-4242.txt', 'w').write('s3cr3t')\nopen('/tmp/secret-4242.txt', 'w').write('s3cr3t')\ntime.sleep(0.8)\n"
    reader = (
        "import os, time\ntime.sleep(0.3)\nfound = []\n"
        "tops = [os.path.join('/', d) for d in os.listdir('/') if d != 'usr' and not os.path.islink('/' + d)]\n"
        "for top in tops:\n"
        "    for d, _, files in os.walk(top):\n"
        "        found += [os.path.join(d, f) for f in files if 'secret-4242' in f]\n"
        "print(found)\nassert not found\n"
    )
    w, r = sandbox.run([Job(writer), Job(reader)])
    assert w.verdict == "pass" and r.verdict == "pass", (w, r)


def test_another_workspace_is_invisible(sandbox, tmp_path):
    from sandbox.runner import Job
    from sandbox.workspace import Workspace

    with Workspace(root=tmp_path / "a") as a, Workspace(root=tmp_path / "b") as b:
        [w] = sandbox.run([Job("open('/workspace/secret.txt', 'w').write('x')\n")], a)
        [r] = sandbox.run([Job(f"import os\nprint(os.listdir('/workspace'))\nopen({str(a._upper)!r} + '/secret.txt')\n")], b)
    assert w.verdict == "pass"
    assert r.stdout.strip() == "[]" and r.verdict == "error" and r.feedback["type"] == "FileNotFoundError"


@pytest.mark.parametrize("path", ["/usr/evil", "/evil", "/harness.py", "/seccomp.bpf", "/dev/evil"])
def test_cannot_write_outside_the_work_directory(sandbox, path):
    r = run1(sandbox, f"open({path!r}, 'w').write('x')\n")
    assert r.verdict == "error" and r.feedback["type"] in ("OSError", "PermissionError"), r


def test_signals_cannot_reach_the_harness_or_other_jobs(sandbox):
    from sandbox.runner import Job

    attacker = "import os, signal\nfor pid in (1, 0, -1, os.getppid()):\n    try:\n        os.kill(pid, signal.SIGKILL)\n    except OSError:\n        pass\n"
    victim = "import time\ntime.sleep(0.5)\nprint('survived')\n"
    a, v = sandbox.run([Job(attacker), Job(victim)])
    assert v.verdict == "pass" and v.stdout.strip() == "survived"


def test_symlinks_in_the_workspace_do_not_escape(sandbox, tmp_path):
    from sandbox.workspace import Workspace

    base = tmp_path / "base"
    base.mkdir()
    (base / "shadow").symlink_to("/etc/shadow")
    (base / "hostroot").symlink_to("/")
    (base / "up").symlink_to("../../../../../../")
    with Workspace(base, root=tmp_path / "ws") as ws:
        from sandbox.runner import Job

        src = (
            "import os\nprint(sorted(os.listdir('hostroot')), sorted(os.listdir('up')))\n"
            "assert 'root' not in os.listdir('hostroot') and 'work' not in os.listdir('up')\n"
            "os.symlink('/etc', 'etc2')\nassert os.listdir('etc2') == ['alternatives'], os.listdir('etc2')\n"
        )
        [r] = sandbox.run([Job(src)], ws)
        [s] = sandbox.run([Job("open('shadow').read()\n")], ws)
    assert r.verdict == "pass", r  # a symlink to /etc resolves to the sandbox's /etc (alternatives only)
    assert s.verdict == "error" and s.feedback["type"] == "FileNotFoundError"
    assert (base / "shadow").is_symlink() and not (base / "etc2").exists()  # the base tree was not written


def test_tests_cannot_be_read_early_or_edited(sandbox):
    src = (
        "import os\nprint(os.listdir('/tests'), os.listdir('/t'))\n"
        "def answer():\n"
        "    try:\n        open('/tests/test_task.py', 'w').write('assert True')\n    except OSError as e:\n        print('edit refused:', e)\n"
        "    return 41\n"
    )
    r = run1(sandbox, src, tests="assert answer() == 42\n")
    assert r.stdout.startswith("[] []") and "Read-only file system" in r.stdout
    assert r.verdict == "fail" and r.tests == {"passed": 0, "total": 1, "failed": ["assert at line 1: assert answer() == 42"]}


def test_exiting_before_the_tests_is_not_a_pass(sandbox):
    for src in ("import sys\nsys.exit(0)\n", "import os\nos._exit(0)\n"):
        r = run1(sandbox, src, tests="assert False\n")
        assert r.verdict == "error", r


def test_setuid_fails(sandbox):
    r = run1(sandbox, "import os\nprint(os.getuid(), os.getgid())\nos.setuid(0)\n")
    assert r.stdout.split() == ["65534", "65534"]
    assert r.verdict == "error" and r.feedback["type"] in ("PermissionError", "OSError")


LIBC = "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"


def test_ptrace_is_refused(sandbox):
    r = run1(sandbox, LIBC + "assert libc.ptrace(0, 0, 0, 0) == -1 and ctypes.get_errno() == 1\nprint('refused')\n")
    assert r.verdict == "pass" and "refused" in r.stdout, r


@pytest.mark.parametrize(
    "call",
    [
        "libc.mount(b'tmpfs', b'/w', b'tmpfs', 0, None)",
        "libc.unshare(0x00020000)",
        "libc.unshare(0x10000000)",
        "libc.syscall(321, 0, 0, 0)",  # bpf
        "libc.syscall(425, 8, 0)",  # io_uring_setup
    ],
    ids=["mount", "unshare-mount", "unshare-user", "bpf", "io_uring"],
)
def test_privileged_calls_are_refused(sandbox, call):
    r = run1(sandbox, LIBC + f"rc = {call}\nassert rc == -1 and ctypes.get_errno() == 1, (rc, ctypes.get_errno())\n")
    assert r.verdict == "pass", r


def test_environment_is_not_passed_in(sandbox, monkeypatch):
    monkeypatch.setenv("CONVEYOR_SECRET", "hunter2")
    r = run1(sandbox, "import os\nprint(sorted(os.environ.items()))\n")
    assert "hunter2" not in r.stdout and "CONVEYOR" not in r.stdout


def test_results_carry_feedback_and_peak_memory(sandbox):
    r = run1(sandbox, "x = 1\n\ndef f(a):\n    return a[3]\n\nf([])\n")
    assert r.verdict == "error"
    assert r.feedback == {"type": "IndexError", "message": "list index out of range", "file": "solution.py", "line": 4}
    ok = run1(sandbox, "b = bytearray(40 << 20)\nb[::4096] = b'x' * len(b[::4096])\n")
    assert ok.verdict == "pass" and ok.peak_memory_mb >= 40


def test_identical_programs_run_once_and_keep_order(sandbox):
    results = sandbox.run_batch(["print(1)\n", "print(2)\n", "print(1)\n"])
    assert [r.stdout.strip() for r in results] == ["1", "2", "1"]


def test_cgroup_limits_the_batch_when_available(sandbox):
    if sandbox.cgroup_version is None:
        pytest.skip("no writable cgroups on this host: the sandbox runs with rlimits only (logged at start)")
    # Eight processes of 100 MB each stay under the per-process RLIMIT_AS but not under the batch's cgroup.
    src = (
        "import os, time\npids = []\n"
        "for _ in range(8):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        b = bytearray(100 << 20)\n        b[::4096] = b'x' * len(b[::4096])\n        time.sleep(1)\n        os._exit(0)\n"
        "    pids.append(pid)\n"
        "codes = [os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids]\n"
        "print(codes)\nassert -9 in codes\n"
    )
    from sandbox.runner import Sandbox, SandboxLimits

    # The time limit is not what is tested: 20 s leaves room for eight forks on a busy machine.
    small = Sandbox(SandboxLimits(timeout_s=20, memory_mb=128, tmp_mb=8), parallel=1)
    try:
        r = small.run_batch([src])[0]
    finally:
        small.close()
    assert r.verdict == "pass", r


def test_nothing_carries_over_to_the_next_job(sandbox):
    """A slot's supervisor serves job after job: the next one sees none of the last one's files,
    processes or System V IPC objects."""
    from sandbox.runner import Job

    shm = "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nlibc.shmget.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_int]\n"
    first = (
        "import os, subprocess\nopen('left.txt', 'w').write('x')\nopen('/tmp/left.txt', 'w').write('x')\n"
        "open('/dev/shm/left', 'w').write('x')\nsubprocess.Popen(['/bin/sleep', '30'], start_new_session=True)\n"
        "if os.fork() == 0:\n    os.setsid()\n    os.execv('/bin/sleep', ['sleep', '31'])\n"
        + shm + "assert libc.shmget(4242, 4096, 0o1600) >= 0, ctypes.get_errno()\n"  # IPC_CREAT | 0600, never removed
    )  # fmt: skip
    second = (
        "import os\nseen = [p for p in ('left.txt', '/tmp/left.txt', '/dev/shm/left') if os.path.exists(p)]\n"
        "def alive(pid):\n    try:\n        os.kill(pid, 0)\n    except ProcessLookupError:\n        return False\n    return True\n"
        "others = [pid for pid in range(2, os.getpid()) if alive(pid)]\n"
        + shm + "segment = libc.shmget(4242, 0, 0)\n"
        "print(os.getpid(), seen, others, segment, os.listdir('.'), os.listdir('/tmp'))\n"
        "assert not seen and not others and segment == -1\n"
    )  # fmt: skip
    results = [
        r
        for pair in (sandbox.run([Job(first), Job(first + "#2\n")]), sandbox.run([Job(second), Job(second + "#2\n")]))
        for r in pair
    ]
    assert all(r.verdict == "pass" for r in results), results
    pids = [int(r.stdout.split()[0]) for r in results[2:]]
    if sandbox.warm:  # the same supervisors served the second batch: the checks above saw a used namespace
        assert max(pids) > 2, pids
