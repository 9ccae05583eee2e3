"""Runs inside the bubblewrap sandbox: a fork server that executes a batch of
jobs, each isolated from the others, and prints one JSON result per job.

Standard library only: it runs on the system interpreter inside bubblewrap,
where the project's environment is not mounted. Request on stdin::

    {"jobs": [{"kind": "python", "source": "...", "tests": null | {"name": "...",
               "style": "assert" | "functions"}, "cwd": "/w" | "/workspace"},
              {"kind": "command", "argv": ["/bin/sh", "-c", "..."], "cwd": ...}],
     "limits": {"timeout_s": 2.0, "memory_mb": 256, "max_output_bytes": 4096,
                "tmp_mb": 16, "nproc": 64, "file_mb": 4, "open_files": 64},
     "parallel": 2}

Per parallel slot, one supervisor; per job, one model process::

    harness ── supervisor S  (clone into new mount/pid/ipc namespaces: pid 1 of its own)
                  └── model process M (a fresh IPC namespace): no capabilities,
                      no_new_privs, not dumpable, seccomp, rlimits

S serves its slot's jobs one at a time: the harness sends it a job and the
write ends of the job's output pipes over a unix socket (``SCM_RIGHTS``).
For each job S mounts fresh, size-limited tmpfs directories (``/tmp``,
``/dev/shm``, the working directory ``/w`` unless the job runs in the
workspace overlay bwrap mounted) and forks M. When M is done, S kills every
process left in its pid namespace (``kill(-1)`` from pid 1 reaches all of
them and nothing outside), reaps them, unmounts the job's tmpfs and only
then reports M's exit status: no daemon and no file survives its job. Jobs
with tests get the test source from S over a pipe only after M reports
that the solution's own code has finished; ``/t``, where the sandbox put
every job's tests, is hidden under an empty tmpfs before any M exists (S
keeps a directory descriptor to it). ``/proc`` is hidden the same way.
On a timeout or an output overrun the harness SIGKILLs S: the kernel kills
everything in its namespace, and the slot's next job gets a new S.

A slot's S lives as long as the harness (warm mode) or the batch, not one
job: with a supervisor and namespaces per job (two processes per job), their
start-up, exit and copy-on-write faults are a large share of a small
program's CPU (docs/BENCHMARKS.md, "A supervisor per slot").

S is created by the ``clone`` system call with the namespace flags (fork
semantics: the child resumes where the parent called it), not by ``unshare``
and ``fork``: ``unshare(CLONE_NEWPID)`` only applies to the caller's *next*
child, so it would need a relay process that stays alive as S's parent. On an
architecture without a known ``clone`` number the relay is used.
"""

import ast
import ctypes
import json
import os
import resource
import select
import signal
import socket
import struct
import sys
import time
import traceback

LIBC = ctypes.CDLL(None, use_errno=True)
# clone(2) through libc's syscall(): PyDLL keeps the GIL held across the call, so the child
# resumes as the same (only) thread holding it. Unused arguments are zero, so the argument
# order, which differs between architectures, does not matter.
_PYLIBC = ctypes.PyDLL(None, use_errno=True)
SYS_CLONE = {"x86_64": 56, "aarch64": 220}.get(os.uname().machine)
CLONE_NEWNS, CLONE_NEWPID, CLONE_NEWIPC = 0x00020000, 0x20000000, 0x08000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REC, MS_PRIVATE = 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_SECCOMP, PR_CAPBSET_DROP = 1, 4, 22, 24
PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 38, 47, 4
MNT_DETACH = 2
SECCOMP_MODE_FILTER = 2
MEMORY_EXIT = 137  # M's exit code after a MemoryError
SOLUTION = "solution.py"

JOBS = {}  # the batch; cleared in every supervisor and model process
SLOTS = []  # the supervisors, one per parallel slot (None: not started yet)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]


def _ok(rc, what):
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, "%s: %s" % (what, os.strerror(err)))


def _mount(src, dst, fstype, flags, data=None):
    _ok(LIBC.mount(src, dst, fstype, flags, data), "mount %s" % dst.decode())


# --------------------------------------------------------------------------
# the model process


def _limits(lim):
    mem = int(lim["memory_mb"]) << 20
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    cpu = int(float(lim["timeout_s"])) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    fsize = int(lim.get("file_mb", 4)) << 20
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    nofile = int(lim.get("open_files", 64))
    resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
    nproc = int(lim.get("nproc", 64))
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _drop_privileges(bpf):
    for cap in range(64):
        LIBC.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)
    LIBC.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    header = ctypes.create_string_buffer(b"\x22\x05\x08\x20" + b"\x00" * 4)  # _LINUX_CAPABILITY_VERSION_3, pid 0
    _ok(LIBC.capset(header, ctypes.create_string_buffer(24)), "capset")
    _ok(LIBC.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    _ok(LIBC.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "dumpable")
    prog = _SockFprog(len(bpf) // 8, bpf)
    _ok(LIBC.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0), "seccomp")


def _feedback_from(exc_info):
    etype, value, tb = exc_info
    frames = [f for f in traceback.extract_tb(tb) if f.filename == SOLUTION]
    fb = {"type": etype.__name__, "message": str(value)[:500]}
    if frames:
        fb["file"], fb["line"] = SOLUTION, frames[-1].lineno
    elif isinstance(value, SyntaxError) and value.filename == SOLUTION:
        fb["file"], fb["line"] = SOLUTION, value.lineno
    return fb


def _run_tests(ns, tests_src, style, filename):
    """Run the tests against the solution's namespace; one entry per test."""
    tree = ast.parse(tests_src, filename)
    outcomes = []
    if style == "assert":
        # Every top-level assert is a test; other statements are set-up.
        for node in tree.body:
            code = compile(ast.Module(body=[node], type_ignores=[]), filename, "exec")
            name = "assert at line %d: %s" % (node.lineno, (ast.get_source_segment(tests_src, node) or "")[:120])
            try:
                exec(code, ns)
                if isinstance(node, ast.Assert):
                    outcomes.append((name, True, None))
            except BaseException:  # noqa: BLE001 - a failing test is a result
                outcomes.append(
                    (
                        name if isinstance(node, ast.Assert) else "set-up at line %d" % node.lineno,
                        False,
                        _feedback_from(sys.exc_info()),
                    )
                )
                if not isinstance(node, ast.Assert):
                    break
    else:
        exec(compile(tree, filename, "exec"), ns)
        names = [n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test")]
        for name in names:
            try:
                ns[name]()
                outcomes.append((name, True, None))
            except BaseException:  # noqa: BLE001
                outcomes.append((name, False, _feedback_from(sys.exc_info())))
    return outcomes


def close_fds_except(keep):
    low = 0
    for fd in sorted(keep):
        if fd > low:  # closerange(n, n) would close everything from n on
            os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, 4096)


def _model(job, lim, bpf, fds):
    out_w, err_w, rep_w, ready_w, go_r = fds
    os.dup2(out_w, 1)
    os.dup2(err_w, 2)
    close_fds_except({0, 1, 2, rep_w, ready_w, go_r})
    os.setsid()
    JOBS.clear()
    os.chdir(job["cwd"])
    env = {"PATH": "/usr/bin:/bin", "HOME": job["cwd"], "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
    try:
        _ok(LIBC.unshare(CLONE_NEWIPC), "unshare ipc")  # System V objects die with the job
        _limits(lim)
        _drop_privileges(bpf)
    except OSError as exc:
        os.write(2, ("sandbox set-up failed: %s\n" % exc).encode())
        os._exit(126)
    if job["kind"] == "command":
        try:
            os.execve(job["argv"][0], job["argv"], env)
        except OSError as exc:
            os.write(2, ("cannot execute %s: %s\n" % (job["argv"][0], exc)).encode())
            os._exit(127)
    os.environ.clear()
    os.environ.update(env)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    sys.argv = [SOLUTION]
    report = os.fdopen(rep_w, "w")
    ns = {"__name__": "__main__", "__builtins__": __builtins__, "__file__": SOLUTION}
    code = 0
    try:
        exec(compile(job["source"], SOLUTION, "exec"), ns)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if job.get("tests"):
            report.write(json.dumps({"error": {"type": "SystemExit", "message": "the solution exited before the tests ran"}}))
            code = code or 1
    except MemoryError:
        code = MEMORY_EXIT
        sys.stderr.write("MemoryError\n")
    except BaseException:  # noqa: BLE001 - report whatever the program raised
        code = 1
        etype, value, tb = sys.exc_info()
        sys.stderr.write("".join(traceback.format_exception(etype, value, tb.tb_next, limit=-8)))  # not our frame
        report.write(json.dumps({"error": _feedback_from(sys.exc_info())}))
    else:
        tests = job.get("tests")
        if tests:
            os.write(ready_w, b"1")
            with os.fdopen(go_r, "rb") as fh:
                sent = fh.read()
            if not sent.startswith(b"1"):  # the supervisor could not read them
                os.write(2, sent[1:] or b"sandbox: no tests arrived\n")
                os._exit(125)
            path = "/tests/" + tests["file"]
            try:
                src = sent[1:].decode()
                outcomes = _run_tests(ns, src, tests.get("style", "assert"), path)
            except MemoryError:
                os._exit(MEMORY_EXIT)
            except BaseException:  # noqa: BLE001 - a broken test file is the task's fault, but report it
                report.write(json.dumps({"error": _feedback_from(sys.exc_info())}))
                code = 1
            else:
                report.write(json.dumps({"tests": [[n, ok, fb] for n, ok, fb in outcomes]}))
                code = 0 if outcomes and all(ok for _, ok, _ in outcomes) else 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        report.flush()
    except BaseException:  # noqa: BLE001
        pass
    os._exit(code)


# --------------------------------------------------------------------------
# the supervisor: pid 1 of a slot's namespaces, one job at a time


def _recv_exact(sock, n, first=b""):
    data = bytearray(first)
    while len(data) < n:
        chunk = sock.recv(min(n - len(data), 1 << 20))
        if not chunk:
            raise EOFError("the harness closed the slot mid-message")
        data += chunk
    return bytes(data)


def _receive(sock):
    """The next job and the write ends of its pipes; None when the harness closed the slot."""
    head, fds, flags, _ = socket.recv_fds(sock, 8, 4)
    if not head:
        return None
    if flags & socket.MSG_CTRUNC or len(fds) != 4:
        raise OSError("a job arrived without its four pipes")
    (size,) = struct.unpack("!Q", _recv_exact(sock, 8, head))
    request = json.loads(_recv_exact(sock, size))
    return request["job"], request["limits"], fds


def _fresh_tmpfs(path, flags, opts):
    _mount(b"tmpfs", path, b"tmpfs", flags, opts)
    return path


def _read_tests(tests_dir_fd, tests):
    fd = os.open("%s/%s" % (tests["dir"], tests["file"]), os.O_RDONLY, dir_fd=tests_dir_fd)
    with os.fdopen(fd, "rb") as fh:
        return fh.read()


def _write_all(fd, data):
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _serve_job(job, lim, bpf, tests_dir_fd, fds):
    """Run one job in this namespace; leave nothing of it behind; report M's status."""
    out_w, err_w, rep_w, status_w = fds
    opts = ("size=%dm,mode=0700,nr_inodes=4096" % int(lim.get("tmp_mb", 16))).encode()
    mounts = [_fresh_tmpfs(b"/tmp", MS_NOSUID | MS_NODEV, opts),
              _fresh_tmpfs(b"/dev/shm", MS_NOSUID | MS_NODEV | MS_NOEXEC, opts)]  # fmt: skip
    if job["cwd"] == "/w":
        mounts.append(_fresh_tmpfs(b"/w", MS_NOSUID | MS_NODEV, opts))
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(ready_r)
            os.close(go_w)
            os.close(status_w)
            _model(job, lim, bpf, (out_w, err_w, rep_w, ready_w, go_r))
        finally:
            os._exit(126)  # _model exits on every path it knows; never back into the supervisor's loop
    for fd in (out_w, err_w, rep_w, ready_w, go_r):
        os.close(fd)
    tests = job.get("tests")
    if tests and os.read(ready_r, 1) == b"1":  # the solution's own code has finished
        try:
            sent = b"1" + _read_tests(tests_dir_fd, tests)
        except OSError as exc:
            sent = ("0sandbox: cannot read the tests: %s\n" % exc).encode()
        try:
            _write_all(go_w, sent)
        except BrokenPipeError:  # M is gone (killed, or exited on its own)
            pass
    os.close(ready_r)
    os.close(go_w)
    status = None
    while status is None:  # as pid 1, reap every orphan too; stop when M is done
        wpid, code, usage = os.wait4(-1, 0)
        if wpid == pid:
            status = {"status": code, "maxrss_kb": usage.ru_maxrss}
    try:
        os.kill(-1, signal.SIGKILL)  # from pid 1: every other process of this namespace, nothing outside it
    except ProcessLookupError:  # none left
        pass
    while True:
        try:
            os.wait4(-1, 0)
        except ChildProcessError:
            break
    for path in mounts:  # its files go with it
        _ok(LIBC.umount2(path, MNT_DETACH), "umount %s" % path.decode())
    os.write(status_w, json.dumps(status).encode())
    os.close(status_w)


def _supervisor(ctl_fd, bpf):
    LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    os.setsid()  # kill(0, ...) from a job must not reach the harness's process group
    JOBS.clear()
    null = os.open("/dev/null", os.O_RDWR)
    os.dup2(null, 0)  # not the harness's request pipe: a job's stdin reads nothing
    os.dup2(null, 1)
    close_fds_except({0, 1, 2, ctl_fd})  # nothing of the harness's other jobs and slots stays open here
    _mount(None, b"/", None, MS_REC | MS_PRIVATE)
    _mount(b"tmpfs", b"/proc", b"tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, b"size=4k,mode=0555")
    # Every job's tests are under /t: S keeps a descriptor to it, no job sees it.
    tests_dir_fd = os.open("/t", os.O_RDONLY | os.O_DIRECTORY)
    _mount(b"tmpfs", b"/t", b"tmpfs", MS_RDONLY, b"size=4k,mode=0555")
    sock = socket.socket(fileno=ctl_fd)
    while True:
        got = _receive(sock)
        if got is None:
            os._exit(0)
        job, lim, fds = got
        _serve_job(job, lim, bpf, tests_dir_fd, fds)  # raises: the job gets no status (infra), the slot ends


def _report_failure(what, exc):
    try:
        os.write(2, ("%s: %s\n" % (what, exc)).encode())
    except OSError:
        pass


def _become_supervisor(ctl_fd, bpf):
    """In the new process: serve as the slot's supervisor, then exit (never back into the harness's code)."""
    try:
        _supervisor(ctl_fd, bpf)
    except BaseException as exc:  # noqa: BLE001
        _report_failure("sandbox supervisor failed", exc)
    finally:
        os._exit(125)


def _start_supervisor(ctl_fd, bpf):
    """S as pid 1 of new mount, pid and IPC namespaces, serving ``ctl_fd``; returns the pid to kill."""
    if SYS_CLONE is None:
        return _start_relay(ctl_fd, bpf)
    flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | signal.SIGCHLD
    pid = _PYLIBC.syscall(SYS_CLONE, flags, 0, 0, 0, 0)
    if pid < 0:
        err = ctypes.get_errno()
        raise OSError(err, "clone: %s" % os.strerror(err))
    if pid == 0:
        _become_supervisor(ctl_fd, bpf)
    return pid


def _start_relay(ctl_fd, bpf):
    """Without a known clone number: a relay unshares, forks S as the first child of the new pid
    namespace and waits for it (S dies with the relay: killing the relay ends the slot)."""
    pid = os.fork()
    if pid == 0:
        try:
            close_fds_except({0, 1, 2, ctl_fd})  # as S does: it lives as long as S
            _ok(LIBC.unshare(CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC), "unshare")
            child = os.fork()
            if child == 0:
                _become_supervisor(ctl_fd, bpf)
            os.waitpid(child, 0)
        except BaseException as exc:  # noqa: BLE001
            _report_failure("sandbox relay failed", exc)
        finally:
            os._exit(0)
    return pid


class _Slot:
    """The harness's end of one supervisor: a socket to send it jobs, its pid to kill it."""

    def __init__(self, bpf):
        self.ctl, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.pid = _start_supervisor(theirs.fileno(), bpf)
        except BaseException:
            self.ctl.close()
            raise
        finally:
            theirs.close()
        self.alive = True

    def send(self, job, lim, write_fds):
        body = json.dumps({"job": job, "limits": lim}).encode()
        socket.send_fds(self.ctl, [struct.pack("!Q", len(body))], write_fds)
        self.ctl.sendall(body)

    def kill(self):
        """End the slot now: its namespace and everything in it die with S."""
        if self.alive:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.close()

    def close(self):
        """Let S finish (it exits when it reads the end of its socket) and reap it."""
        if self.alive:
            self.alive = False
            self.ctl.close()
            os.waitpid(self.pid, 0)


def _slot(i, bpf):
    while len(SLOTS) <= i:
        SLOTS.append(None)
    if SLOTS[i] is None or not SLOTS[i].alive:
        SLOTS[i] = _Slot(bpf)
    return SLOTS[i]


def close_slots():
    for slot in SLOTS:
        if slot is not None:
            slot.close()
    del SLOTS[:]


# --------------------------------------------------------------------------
# the harness: start jobs, collect output, enforce wall-clock and output limits


class _Job:
    def __init__(self, index, job, lim, slot):
        self.index = index
        self.kind = job["kind"]
        self.has_tests = bool(job.get("tests"))
        pipes = []  # out, err, report, status
        try:
            for _ in range(4):
                pipes.append(os.pipe())
            self.start = time.monotonic()
            self.deadline = self.start + float(lim["timeout_s"])
            slot.send(job, lim, [w for _, w in pipes])
        except OSError:  # not started (EMFILE, or the slot's supervisor is gone): nothing leaks
            for r, w in pipes:
                os.close(r)
                os.close(w)
            raise
        for _, w in pipes:
            os.close(w)
        self.slot = slot
        self.fds = [r for r, _ in pipes]
        self.out_r, self.err_r, self.rep_r, self.status_r = self.fds
        self.bufs = {fd: bytearray() for fd in self.fds}
        self.open_fds = list(self.fds)
        self.truncated = False
        self.timed_out = False

    def read(self, fd, max_output):
        chunk = os.read(fd, 65536)
        if not chunk:
            self.open_fds.remove(fd)
            return
        cap = max_output if fd in (self.out_r, self.err_r) else 1 << 20
        room = cap - len(self.bufs[fd])
        if room > 0:
            self.bufs[fd] += chunk[:room]
        if len(chunk) > room and fd in (self.out_r, self.err_r):
            self.truncated = True
            self.kill()

    def kill(self):
        self.slot.kill()  # its supervisor, and with it everything in its namespace

    def finish(self):
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        try:
            status = json.loads(bytes(self.bufs[self.status_r]) or b"null")
        except ValueError:
            status = None
        try:
            report = json.loads(bytes(self.bufs[self.rep_r]) or b"null") or {}
        except ValueError:
            report = {}
        if status is None:  # the supervisor died (or was killed) before reporting: the slot is gone
            self.slot.kill()
            if not (self.timed_out or self.truncated):
                self.bufs[self.err_r] += b"sandbox: the job's supervisor ended before reporting its status\n"
        exit_code = os.waitstatus_to_exitcode(status["status"]) if status else None
        peak_mb = round(status["maxrss_kb"] / 1024, 2) if status else None
        stderr = self.bufs[self.err_r].decode(errors="replace")
        tests = report.get("tests")
        feedback = report.get("error")
        if tests is not None:
            failed = [t for t in tests if not t[1]]
            if failed:
                feedback = dict(failed[0][2] or {}, failing_test=failed[0][0])
        if self.timed_out or exit_code == -signal.SIGXCPU:
            verdict = "timeout"
        elif self.truncated:
            verdict = "output_limit"
        elif exit_code == MEMORY_EXIT or exit_code == -signal.SIGKILL:
            verdict = "memory"  # MemoryError, or killed by the cgroup's OOM killer
        elif exit_code is None:
            verdict = "infra"
        elif self.has_tests:
            if tests:
                verdict = "pass" if all(t[1] for t in tests) else "fail"
            else:
                verdict = "error"
        elif exit_code == 0:
            verdict = "pass"
        elif self.kind == "command":
            verdict = "fail"
        elif feedback is not None and feedback.get("type") == "AssertionError":
            verdict = "fail"
        else:
            verdict = "error"
        return _result(
            verdict,
            exit_code,
            self.bufs[self.out_r].decode(errors="replace"),
            stderr,
            round(time.monotonic() - self.start, 4),
            peak_mb,
            feedback,
            None
            if tests is None
            else {"passed": sum(1 for t in tests if t[1]), "total": len(tests), "failed": [t[0] for t in tests if not t[1]][:20]},
        )


def _result(verdict, exit_code=None, stdout="", stderr="", duration_s=0.0, peak_memory_mb=None, feedback=None, tests=None):
    """One job's result, as the sandbox reads it back (every key, every time)."""
    return {
        "verdict": verdict,
        "exit_code": exit_code,
        "stdout": stdout,
        "stderr": stderr,
        "duration_s": duration_s,
        "peak_memory_mb": peak_memory_mb,
        "feedback": feedback,
        "tests": tests,
    }


def _not_started(exc):
    """The result of a job whose process could not be started: the sandbox failed, not the program."""
    return _result("infra", stderr="sandbox: could not start the job: %s\n" % exc)


def _start(index, job, lim, bpf, slot_index):
    """Send a job to its slot's supervisor; a supervisor found dead is replaced once."""
    for attempt in (0, 1):
        slot = _slot(slot_index, bpf)  # may raise: clone refused (EAGAIN at the pids limit)
        try:
            return _Job(index, job, lim, slot)
        except OSError as exc:
            if not isinstance(exc, (BrokenPipeError, ConnectionResetError)) or attempt:
                raise
            slot.kill()


def run_all(jobs, lim, bpf, parallel):
    """Run every job, at most ``parallel`` at a time; results in input order."""
    JOBS.update(enumerate(jobs))
    results = [None] * len(jobs)
    queue = list(range(len(jobs)))
    running = {}  # slot index -> job
    max_output = int(lim["max_output_bytes"])
    while queue or running:
        while queue and len(running) < parallel:
            index = queue.pop(0)
            slot_index = min(set(range(parallel)) - set(running))
            try:
                running[slot_index] = _start(index, JOBS[index], lim, bpf, slot_index)
            except OSError as exc:  # this job could not start; the batch's other jobs still run
                results[index] = _not_started(exc)
        if not running:
            continue
        fds = {fd: job for job in running.values() for fd in job.open_fds}
        wait = max(0.0, min(job.deadline for job in running.values()) - time.monotonic())
        ready = select.select(list(fds), [], [], wait)[0] if fds else []
        for fd in ready:
            fds[fd].read(fd, max_output)
        now = time.monotonic()
        for slot_index, job in list(running.items()):
            if job.open_fds and now >= job.deadline:
                job.timed_out = True
                job.kill()
                for fd in list(job.open_fds):  # what it wrote before the kill still counts
                    while select.select([fd], [], [], 0)[0] and fd in job.open_fds:
                        job.read(fd, max_output)
                job.open_fds = []
            if not job.open_fds:
                results[job.index] = job.finish()
                del running[slot_index]
    return results


def main():
    with open("/seccomp.bpf", "rb") as fh:
        bpf = fh.read()
    if "--serve" in sys.argv:
        # Warm mode: one request per line on stdin, one line of results per request; the
        # slots' supervisors serve request after request.
        for line in sys.stdin:
            request = json.loads(line)
            parallel = int(request.get("parallel", 2))
            results = run_all(request["jobs"], request["limits"], bpf, parallel)
            JOBS.clear()
            sys.stdout.write(json.dumps(results) + "\n")
            sys.stdout.flush()
            for i in range(parallel):  # a slot killed by this request is replaced before the next
                try:
                    _slot(i, bpf)
                except OSError:
                    pass  # the next request's job on it reports why
        close_slots()
        return
    request = json.load(sys.stdin)
    results = run_all(request["jobs"], request["limits"], bpf, int(request.get("parallel", 2)))
    close_slots()
    for result in results:
        sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
