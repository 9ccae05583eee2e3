"""Runs inside the sandbox: executes a batch of Python programs, one forked
child each, and prints one JSON result per program.

Standard library only (it runs on the system interpreter inside bubblewrap,
where the project's environment is not mounted). Input on stdin::

    {"programs": ["print(1)", ...], "timeout_s": 2.0, "memory_mb": 256,
     "max_output_bytes": 4096, "parallel": 2}

At most ``parallel`` children run at once. Each child gets its own session (so a timeout kills its whole process
group), rlimits (address space, CPU, file size, open files, processes), an
empty working directory, and its stdout/stderr captured and capped.
"""

import json
import os
import resource
import select
import signal
import sys
import tempfile
import time
import traceback


def _limits(timeout_s, memory_mb):
    mem = memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    cpu = int(timeout_s) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    resource.setrlimit(resource.RLIMIT_NPROC, (32, 32))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _child(src, workdir, out_w, err_w, timeout_s, memory_mb):
    os.setsid()
    os.dup2(out_w, 1)
    os.dup2(err_w, 2)
    os.chdir(workdir)
    code = 0
    try:
        _limits(timeout_s, memory_mb)
        sys.stdout = os.fdopen(1, "w", buffering=1)
        sys.stderr = os.fdopen(2, "w", buffering=1)
        exec(compile(src, "<program>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except MemoryError:
        code = 137
        sys.stderr.write("MemoryError\n")
    except BaseException:  # noqa: BLE001 - report whatever the program raised
        code = 1
        etype, value, tb = sys.exc_info()
        frames = [f for f in traceback.extract_tb(tb) if f.filename == "<program>"]
        line = frames[-1].lineno if frames else None
        sys.stderr.write(traceback.format_exc(limit=-3))
        sys.stderr.write("\n__FEEDBACK__" + json.dumps({"type": etype.__name__, "message": str(value)[:500], "line": line}))
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:  # noqa: BLE001
        pass
    os._exit(code)


class _Run:
    """One program's child process and what it has written so far."""

    def __init__(self, index, src, timeout_s, memory_mb):
        self.index = index
        workdir = tempfile.mkdtemp(prefix="run-", dir="/tmp")
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        self.start = time.monotonic()
        self.deadline = self.start + timeout_s
        pid = os.fork()
        if pid == 0:
            os.close(out_r)
            os.close(err_r)
            _child(src, workdir, out_w, err_w, timeout_s, memory_mb)
        os.close(out_w)
        os.close(err_w)
        self.pid = pid
        self.out_r, self.err_r = out_r, err_r
        self.bufs = {out_r: bytearray(), err_r: bytearray()}
        self.open_fds = [out_r, err_r]
        self.truncated = False
        self.timed_out = False

    def read(self, fd, max_output):
        chunk = os.read(fd, 65536)
        if not chunk:
            self.open_fds.remove(fd)
            return
        room = max_output - len(self.bufs[fd])
        if room > 0:
            self.bufs[fd] += chunk[:room]
        if len(chunk) > room:
            self.truncated = True
            self.kill()

    def kill(self):
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def finish(self):
        _, status = os.waitpid(self.pid, 0)
        self.kill()  # anything the program left behind in its session
        for fd in (self.out_r, self.err_r):
            try:
                os.close(fd)
            except OSError:
                pass
        exit_code = os.waitstatus_to_exitcode(status)
        stderr = self.bufs[self.err_r].decode(errors="replace")
        feedback = None
        if "__FEEDBACK__" in stderr:
            stderr, _, fb = stderr.rpartition("\n__FEEDBACK__")
            try:
                feedback = json.loads(fb)
            except ValueError:
                feedback = None
        if self.timed_out:
            verdict = "timeout"
        elif self.truncated:
            verdict = "output_limit"
        elif exit_code == 0:
            verdict = "pass"
        elif exit_code == 137 or exit_code == -signal.SIGKILL:
            verdict = "memory"
        elif feedback is not None and feedback.get("type") == "AssertionError":
            verdict = "fail"
        else:
            verdict = "error"
        return {
            "verdict": verdict,
            "exit_code": exit_code,
            "stdout": self.bufs[self.out_r].decode(errors="replace"),
            "stderr": stderr,
            "duration_s": round(time.monotonic() - self.start, 4),
            "feedback": feedback,
        }


def run_all(programs, timeout_s, memory_mb, max_output, parallel):
    """Run every program, at most ``parallel`` children at a time; results in input order."""
    results = [None] * len(programs)
    queue = list(enumerate(programs))
    running = []
    while queue or running:
        while queue and len(running) < parallel:
            index, src = queue.pop(0)
            running.append(_Run(index, src, timeout_s, memory_mb))
        fds = {fd: run for run in running for fd in run.open_fds}
        now = time.monotonic()
        wait = max(0.0, min(run.deadline for run in running) - now)
        ready = select.select(list(fds), [], [], wait)[0] if fds else []
        for fd in ready:
            fds[fd].read(fd, max_output)
        now = time.monotonic()
        for run in list(running):
            if run.open_fds and now >= run.deadline:
                run.timed_out = True
                run.kill()
                run.open_fds = []
            if not run.open_fds:
                results[run.index] = run.finish()
                running.remove(run)
    return results


def main():
    request = json.load(sys.stdin)
    results = run_all(
        request["programs"],
        float(request["timeout_s"]),
        int(request["memory_mb"]),
        int(request["max_output_bytes"]),
        int(request.get("parallel", 2)),
    )
    for result in results:
        sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
