"""Run model-written programs and commands in a bubblewrap sandbox.

One ``bwrap`` launch per *batch* (or one for the sandbox's life, warm);
inside it ``sandbox/harness.py`` is a fork server. Each of its parallel slots
has a supervisor, pid 1 of its own mount and pid namespaces, which forks one
model process per job (in an IPC namespace of its own) and, when the job
ends, kills whatever the job left in the namespace and unmounts the job's
tmpfs directories before it takes the next job. The bwrap start, the
interpreter start and the namespaces are paid once per batch or slot while
jobs stay isolated from each other. Identical programs in a batch run once.

What it protects against (each claim has a test in
``tests/integration/test_sandbox_adversarial.py``)
- Network: every namespace is unshared; the only interface is an
  unconfigured loopback, and seccomp refuses sockets of any family but
  AF_UNIX, so neither TCP nor UDP reach anything, loopback included.
- Host files: only ``/usr`` and ``/etc/alternatives`` (read-only), the
  harness and the seccomp filter (read-only), a private size-limited tmpfs working directory and ``/tmp``
  per job, and — for workspace tasks — the workspace overlay are visible.
  ``/etc``, ``/root``, the project tree, other jobs' directories and
  ``/proc`` are not.
- Privilege: uid/gid 65534 in a user namespace; every capability dropped
  (bounding and ambient sets too), ``no_new_privs``, not dumpable;
  ``setuid``, ``ptrace``, ``mount``, ``unshare``, ``bpf``, ``keyctl``,
  ``io_uring`` and the other calls in ``sandbox/seccomp.py`` fail with EPERM.
- Other processes: a job runs in its slot's pid namespace, where the only
  other process is the slot's supervisor (pid 1, which cannot be signalled
  from inside); it cannot see or signal the harness, other jobs, or the host.
- Runaway programs: wall-clock limit per job (SIGKILL of the whole
  namespace), rlimits (address space, CPU seconds, file size, open files,
  processes), a tmpfs size and inode limit on writable directories, output
  capped, and a cgroup (v1 or v2) per batch bounding memory (tmpfs pages
  included) and process count.
- Leftovers: when a job ends its supervisor kills every other process of
  the namespace (``kill(-1)`` from pid 1: no daemon survives it) and reaps
  them, then unmounts the job's tmpfs directories, all before the job's
  status is reported; its System V IPC objects go with its IPC namespace;
  the batch's cgroup is removed; nothing is mounted on the host. The
  sandbox's own directories on the host go on every exit, a killed
  process's with the next sandbox's start (``sandbox/tempdirs.py``).
- Tests: the sandbox writes them under ``/t``, which every job sees as an
  empty read-only directory; the supervisor reads a job's tests (through a
  descriptor it opened before hiding ``/t``) and hands them to the model
  process over a pipe only after the solution's own code has run. A
  solution that exits before the tests ran scores as an error.

What it does not protect against
- Kernel vulnerabilities reachable through the syscalls left allowed: this
  is a namespace sandbox, not a VM (use gVisor/Firecracker hosts for that).
- CPU contention: CPU time is limited per process, not shared fairly.
- In-process test forgery: tests run in the solution's interpreter (that is
  what lets them call its functions), so a solution that inspects the test
  runner's frames could report a pass, and one that writes to the
  descriptor by which its process says "the solution has finished" gets
  the tests early; reward hacking of that kind shows in the logged outputs,
  not in the sandbox's guarantees.
- Where bwrap cannot create namespaces the sandbox refuses to start
  (``SandboxUnavailable``); there is no fallback to a bare subprocess.
- Without writable cgroups (neither v1 nor v2 delegated) memory is bounded
  per process by RLIMIT_AS only; the service logs this loudly at start and
  ``cgroups="required"`` makes it fatal.
"""

from __future__ import annotations

import json
import math
import os
import select
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import structlog

from conveyor.config import RewardConfig
from sandbox import cgroups, tempdirs
from sandbox.images import normalise_roots
from sandbox.seccomp import filter_bpf
from sandbox.workspace import Workspace

log = structlog.get_logger(__name__)
HARNESS = Path(__file__).with_name("harness.py")
Verdict = Literal["pass", "fail", "error", "timeout", "memory", "output_limit", "infra"]


class SandboxUnavailable(RuntimeError):
    """bwrap is missing or cannot create namespaces on this host."""


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 2.0
    memory_mb: int = 256  # address space per process
    max_output_bytes: int = 8192  # stdout and stderr, each
    tmp_mb: int = 16  # each writable tmpfs (work dir, /tmp)
    nproc: int = 64
    file_mb: int = 4
    open_files: int = 64


@dataclass(frozen=True)
class Job:
    """A Python program (run in the fork server) or a command (executed)."""

    source: str = ""
    kind: Literal["python", "command"] = "python"
    argv: tuple[str, ...] = ()
    tests: str | None = None  # run after the solution, against its namespace
    test_style: Literal["assert", "functions"] = "assert"


@dataclass(frozen=True)
class ExecResult:
    verdict: Verdict
    exit_code: int | None
    stdout: str
    stderr: str
    duration_s: float
    peak_memory_mb: float | None = None
    feedback: dict | None = field(default=None)
    tests: dict | None = None  # {"passed", "total", "failed": [names]} for jobs with tests

    def to_dict(self) -> dict:
        return asdict(self)


def _interpreter() -> str:
    # The system interpreter starts in ~26 ms; a pyenv shim costs ~200 ms.
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.access(candidate, os.X_OK):
            return candidate
    raise SandboxUnavailable("no system python3 under /usr to run inside the sandbox")


class Sandbox:
    """Executes batches of jobs; thread-safe.

    Cold (default): each batch is its own bwrap launch and cgroup. Warm
    (``warm=True``): one long-lived bwrap serves batches over a pipe (calls are
    serialised; each job still gets a fresh process, tmpfs and IPC namespace,
    and nothing of an earlier job survives in its slot), which is what a Celery
    worker process scoring one rollout per task wants; it is restarted after
    any failure. Workspace runs always launch cold (the overlay is mounted at
    launch).
    """

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        *,
        parallel: int | None = None,
        cgroups_mode: Literal["auto", "required", "off"] = "auto",
        warm: bool = False,
        image_roots: Sequence[str] = (),
    ) -> None:
        from conveyor.binaries import BinaryMissing, bwrap_binary

        try:
            self.bwrap = str(bwrap_binary())
        except BinaryMissing as exc:
            raise SandboxUnavailable(str(exc)) from None
        self.limits = limits or SandboxLimits()
        self.python = _interpreter()
        self.parallel = parallel or min(4, os.cpu_count() or 1)
        self.last_error: str | None = None
        self.warm = warm
        self.warm_grace_s = 30.0  # a warm request's deadline: the jobs' time limits plus this
        self._warm_lock = threading.Lock()
        self._warm_proc: subprocess.Popen | None = None
        self._warm_cg: cgroups.Cgroup | None = None
        self._warm_buf = b""
        self.image_roots = normalise_roots(image_roots)  # where a task's workspace image may lie
        tempdirs.sweep()  # the directories of sandboxes whose process was killed
        self._tmp = tempdirs.ProcessDir("run", owner=self)
        self._dir = self._tmp.path
        self._bpf = self._dir / "seccomp.bpf"
        self._warm_tests = self._dir / "warm-tests"
        try:
            self._set_up(cgroups_mode)
        except BaseException:
            self.close()
            raise

    def _set_up(self, cgroups_mode: str) -> None:
        try:
            self._bpf.write_bytes(filter_bpf())
        except (ImportError, OSError, RuntimeError) as exc:
            raise SandboxUnavailable(f"cannot build the seccomp filter (libseccomp): {exc}") from None
        self.cgroup_version = None if cgroups_mode == "off" else cgroups.detect()
        self._cgroups = cgroups.CgroupFactory(self.cgroup_version) if self.cgroup_version else None
        if self._cgroups is None and cgroups_mode == "required":
            raise SandboxUnavailable("no writable cgroup v1 or v2 memory+pids controllers (cgroups_mode=required)")
        if self._cgroups is None and cgroups_mode == "auto":
            log.warning("sandbox_without_cgroups", reason="no writable memory+pids controllers; rlimits only")
        elif self._cgroups is not None:
            self._cgroups.sweep()
        self._check()

    # -- launching ---------------------------------------------------------

    @classmethod
    def from_config(cls, reward: RewardConfig, *, parallel: int | None = None, warm: bool = False) -> Sandbox:
        """A sandbox with a run config's ``reward`` limits: the reward service, the rollout worker's
        tool turns and the demo's evaluator all judge under the same ones."""
        limits = SandboxLimits(
            timeout_s=reward.timeout_s,
            memory_mb=reward.memory_mb,
            max_output_bytes=reward.max_output_bytes,
            tmp_mb=reward.tmp_mb,
            nproc=reward.nproc,
        )
        return cls(limits, parallel=parallel, cgroups_mode=reward.cgroups, warm=warm, image_roots=reward.image_roots)

    def _argv(self, tests_dir: Path | None, workspace: Workspace | None) -> list[str]:
        argv = [
            self.bwrap,
            "--unshare-all",
            "--unshare-user",
            "--disable-userns",
            "--uid", "65534",
            "--gid", "65534",
            "--cap-drop", "ALL",
            "--cap-add", "CAP_SYS_ADMIN",  # the harness's, for the slots' namespaces and mounts; jobs drop it
            "--die-with-parent",
            "--new-session",
            "--ro-bind", "/usr", "/usr",
        ]  # fmt: skip
        for link in ("lib", "lib64", "bin", "sbin"):
            if os.path.islink(f"/{link}"):
                argv += ["--symlink", os.readlink(f"/{link}"), f"/{link}"]
        # Debian's alternatives (awk, editor, ...) are symlinks into /etc/alternatives: only that
        # directory of /etc is visible (symlinks to /usr), read-only.
        argv += ["--ro-bind-try", "/etc/alternatives", "/etc/alternatives"]
        argv += [
            "--proc", "/proc",
            "--dev", "/dev",
            "--tmpfs", "/tmp",
            "--dir", "/w",
            "--dir", "/tests",
        ]  # fmt: skip
        argv += ["--ro-bind", str(tests_dir), "/t"] if tests_dir else ["--dir", "/t"]
        if workspace is not None:
            argv += workspace.bwrap_args("/workspace")
        argv += [
            "--ro-bind", str(self._bpf), "/seccomp.bpf",
            "--ro-bind", str(HARNESS), "/harness.py",
            "--remount-ro", "/dev",
            "--remount-ro", "/",
            "--chdir", "/",
            "--clearenv",
            "--setenv", "PATH", "/usr/bin:/bin",
            self.python, "-S", "-I", "/harness.py",
        ]  # fmt: skip
        return argv

    def _check(self) -> None:
        try:
            [r] = self.run([Job("print('ok')")])
        except (OSError, subprocess.SubprocessError) as exc:
            raise SandboxUnavailable(f"bwrap failed to start: {exc}") from None
        if r.verdict != "pass":
            why = self.last_error or r.stderr.strip()[:300]
            raise SandboxUnavailable(f"bwrap cannot run here (user namespaces disabled?): {why}")

    def _specs(self, jobs: Sequence[Job], workspace: Workspace | None, tests_root: Path) -> tuple[list[dict], list[Path]]:
        specs, written = [], []
        for job in jobs:
            spec: dict = {"kind": job.kind, "cwd": "/workspace" if workspace is not None else "/w"}
            if job.kind == "command":
                spec["argv"] = list(job.argv)
            else:
                spec["source"] = job.source
            if job.tests is not None:
                name = uuid.uuid4().hex  # unguessable, and hidden from the job until its solution ran
                (tests_root / name).mkdir(parents=True)
                (tests_root / name / "test_task.py").write_text(job.tests)
                spec["tests"] = {"dir": name, "file": "test_task.py", "style": job.test_style}
                written.append(tests_root / name)
            specs.append(spec)
        return specs, written

    def _in_cgroup(self, argv: list[str], parallel: int) -> tuple[list[str], cgroups.Cgroup | None]:
        if self._cgroups is None:
            return argv, None
        lim = self.limits
        per_job = (lim.memory_mb + 2 * lim.tmp_mb) << 20
        cg = self._cgroups.create(memory_bytes=parallel * per_job + (96 << 20), pids=parallel * (lim.nproc + 4) + 16)
        # Join the cgroup before exec, so bwrap and everything under it is accounted.
        script = 'for f in "$@"; do [ "$f" = -- ] && break; echo $$ > "$f"; shift; done; shift; exec "$@"'
        return ["/bin/sh", "-c", script, "sh", *cg.procs_files, "--", *argv], cg

    @staticmethod
    def _results(lines: list[str], n: int, elapsed: float) -> list[ExecResult]:
        results = []
        for i in range(n):
            if i < len(lines):
                results.append(ExecResult(**json.loads(lines[i])))
            else:
                results.append(ExecResult("infra", None, "", "the sandbox batch did not report this job", elapsed))
        return results

    def run(self, jobs: Sequence[Job], workspace: Workspace | None = None) -> list[ExecResult]:
        """Run every job; results in input order. Never raises for the jobs' faults.

        With a workspace, jobs run one after the other on it (a task's steps).
        """
        if not jobs:
            return []
        if self.warm and workspace is None:
            return self._run_warm(jobs)
        lim = self.limits
        parallel = 1 if workspace is not None else self.parallel
        batch = self._dir / uuid.uuid4().hex[:12]
        specs, written = self._specs(jobs, workspace, batch / "t")
        request = {"jobs": specs, "limits": asdict(lim), "parallel": parallel}
        argv, cg = self._in_cgroup(self._argv(batch / "t" if written else None, workspace), parallel)
        start = time.monotonic()
        rounds = math.ceil(len(jobs) / parallel)
        try:
            res = subprocess.run(
                argv, input=json.dumps(request), capture_output=True, text=True, timeout=lim.timeout_s * rounds + 30
            )
            lines = res.stdout.splitlines()
            if len(lines) != len(jobs):
                self.last_error = f"exit {res.returncode}: {res.stderr.strip()[-500:]}"
                log.error("sandbox_batch_failed", error=self.last_error)
        except subprocess.TimeoutExpired:
            lines = []
            log.error("sandbox_batch_timeout", jobs=len(jobs))
        finally:
            if cg is not None:
                cg.remove()
            shutil.rmtree(batch, ignore_errors=True)
        return self._results(lines, len(jobs), time.monotonic() - start)

    # -- warm mode: one long-lived bwrap, requests over a pipe ---------------

    def _start_warm(self) -> None:
        self._warm_tests.mkdir(exist_ok=True)
        argv, self._warm_cg = self._in_cgroup(self._argv(self._warm_tests, None) + ["--serve"], self.parallel)
        self._warm_proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
        )
        self._warm_buf = b""

    def _stop_warm(self) -> None:
        proc, self._warm_proc = self._warm_proc, None
        if proc is not None:
            try:
                os.killpg(proc.pid, 9)
            except ProcessLookupError:
                pass
            proc.wait()
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()
        if self._warm_cg is not None:
            self._warm_cg.remove()
            self._warm_cg = None

    def _read_line(self, deadline: float) -> bytes | None:
        proc = self._warm_proc
        assert proc is not None and proc.stdout is not None
        fd = proc.stdout.fileno()
        while b"\n" not in self._warm_buf:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                return None
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                return None
            self._warm_buf += chunk
        line, _, self._warm_buf = self._warm_buf.partition(b"\n")
        return line

    def _write_request(self, data: bytes, deadline: float) -> bool:
        """Write a request to the warm harness by ``deadline``: a harness that stopped reading
        (hung) must not block the caller (and the lock every other call waits on) for good."""
        proc = self._warm_proc
        assert proc is not None and proc.stdin is not None
        fd = proc.stdin.fileno()
        os.set_blocking(fd, False)
        view = memoryview(data)
        while view:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([], [fd], [], remaining)[1]:
                return False
            try:
                view = view[os.write(fd, view) :]
            except BlockingIOError:
                continue
        return True

    def _run_warm(self, jobs: Sequence[Job]) -> list[ExecResult]:
        lim = self.limits
        start = time.monotonic()
        with self._warm_lock:
            specs, written = self._specs(jobs, None, self._warm_tests)
            request = {"jobs": specs, "limits": asdict(lim), "parallel": self.parallel}
            line = None
            try:
                if self._warm_proc is None or self._warm_proc.poll() is not None:
                    self._stop_warm()
                    self._start_warm()
                deadline = start + lim.timeout_s * math.ceil(len(jobs) / self.parallel) + self.warm_grace_s
                if self._write_request(json.dumps(request).encode() + b"\n", deadline):
                    line = self._read_line(deadline)
            except (OSError, ValueError) as exc:
                self.last_error = f"warm sandbox: {exc}"
            finally:
                for d in written:
                    shutil.rmtree(d, ignore_errors=True)
            if line is None:
                err = b""
                if self._warm_proc is not None and self._warm_proc.poll() is not None and self._warm_proc.stderr:
                    err = self._warm_proc.stderr.read()[-500:]
                self.last_error = f"warm sandbox did not answer: {err.decode(errors='replace').strip()}"
                log.error("sandbox_warm_failed", error=self.last_error)
                self._stop_warm()  # the next call starts a fresh one
                return self._results([], len(jobs), time.monotonic() - start)
        return self._results([json.dumps(r) for r in json.loads(line)], len(jobs), time.monotonic() - start)

    def run_batch(self, programs: list[str]) -> list[ExecResult]:
        """Run Python programs; identical ones once."""
        unique = list(dict.fromkeys(programs))
        by_src = dict(zip(unique, self.run([Job(src) for src in unique])))
        return [by_src[src] for src in programs]

    def close(self) -> None:
        with self._warm_lock:
            self._stop_warm()
        self._tmp.close()
