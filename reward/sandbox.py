"""Run model-written Python programs in a bubblewrap sandbox.

One ``bwrap`` launch per *batch*: inside it, ``reward/harness.py`` forks one
child per program (a fork server), so the ~20 ms bwrap start and the
interpreter start are paid once per batch, not once per completion.
Identical programs in a batch (common: a group's samples often agree) run
once.

What it protects against
- Network: every namespace is unshared (``--unshare-all``): no interfaces but
  an unconfigured loopback, so no TCP/UDP to the host or the outside.
- Host files: only ``/usr`` (read-only), the harness (read-only), a fresh
  ``/proc``, a minimal ``/dev`` and a private tmpfs ``/tmp`` are visible; the
  project tree, ``/etc``, ``/root`` and other batches' files are not.
- Privilege: uid/gid 65534 inside a user namespace, all capabilities
  dropped, ``--new-session`` (no TIOCSTI into the caller's terminal),
  ``--die-with-parent``.
- Runaway programs: per program a wall-clock limit that SIGKILLs its whole
  session, rlimits on address space, CPU seconds, file size (1 MB), open
  files and processes, capped stdout/stderr; per batch a wall-clock limit on
  the bwrap process.
- Leftovers: each program runs in its own session, which is killed after it
  exits; the sandbox's tmpfs vanishes with the batch.

What it does not (yet) protect against — issue #4 adds them
- No seccomp filter: a program may call any syscall the user namespace
  allows (e.g. create AF_UNIX/AF_INET sockets — which reach nothing).
- No cgroup memory/pids limits: memory is bounded per process by
  RLIMIT_AS, processes by RLIMIT_NPROC; a tmpfs fill is bounded only by the
  batch's own memory.
- Programs of one batch share the sandbox's /tmp (each gets its own empty
  working directory inside it); batches never share anything.
- Where bwrap cannot create a user namespace it refuses (``SandboxUnavailable``);
  there is no silent fallback to a bare subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

HARNESS = Path(__file__).with_name("harness.py")


class SandboxUnavailable(RuntimeError):
    """bwrap is missing or cannot create namespaces on this host."""


@dataclass(frozen=True)
class ExecResult:
    verdict: str  # pass | fail | error | timeout | memory | output_limit | infra
    exit_code: int | None
    stdout: str
    stderr: str
    duration_s: float
    feedback: dict | None = field(default=None)


def _interpreter() -> str:
    # The system interpreter starts in ~26 ms; a pyenv shim costs ~200 ms.
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.access(candidate, os.X_OK):
            return candidate
    raise SandboxUnavailable("no system python3 under /usr to run inside the sandbox")


class PythonSandbox:
    """Executes batches of programs; thread-safe (each batch is its own bwrap)."""

    def __init__(
        self, timeout_s: float = 2.0, memory_mb: int = 256, max_output_bytes: int = 4096, parallel: int | None = None
    ) -> None:
        from conveyor.stack.components import BinaryMissing, bwrap_binary

        try:
            self.bwrap = str(bwrap_binary())
        except BinaryMissing as exc:
            raise SandboxUnavailable(str(exc)) from None
        self.python = _interpreter()
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb
        self.max_output_bytes = max_output_bytes
        self.parallel = parallel or min(4, os.cpu_count() or 1)
        self._check()

    def _argv(self) -> list[str]:
        argv = [
            self.bwrap,
            "--unshare-all",
            "--uid", "65534",
            "--gid", "65534",
            "--cap-drop", "ALL",
            "--die-with-parent",
            "--new-session",
            "--ro-bind", "/usr", "/usr",
        ]
        for link in ("lib", "lib64", "bin"):
            if os.path.islink(f"/{link}"):
                argv += ["--symlink", os.readlink(f"/{link}"), f"/{link}"]
        argv += [
            "--proc", "/proc",
            "--dev", "/dev",
            "--tmpfs", "/tmp",
            "--ro-bind", str(HARNESS), "/harness.py",
            "--chdir", "/tmp",
            "--clearenv",
            "--setenv", "PYTHONDONTWRITEBYTECODE", "1",
            "--setenv", "PATH", "/usr/bin",
            self.python, "-S", "-I", "/harness.py",
        ]
        return argv

    def _check(self) -> None:
        try:
            res = subprocess.run(
                self._argv(), input=json.dumps(self._request(["print('ok')"])), capture_output=True, text=True, timeout=30
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise SandboxUnavailable(f"bwrap failed to start: {exc}") from None
        if res.returncode != 0 or '"pass"' not in res.stdout:
            raise SandboxUnavailable(
                f"bwrap cannot run here (user namespaces disabled?): exit {res.returncode}: {res.stderr.strip()[:300]}"
            )

    def _request(self, programs: list[str]) -> dict:
        return {
            "programs": programs,
            "timeout_s": self.timeout_s,
            "memory_mb": self.memory_mb,
            "max_output_bytes": self.max_output_bytes,
            "parallel": self.parallel,
        }

    def run_batch(self, programs: list[str]) -> list[ExecResult]:
        """Run every program; identical ones once. Never raises for the programs' faults."""
        unique = list(dict.fromkeys(programs))
        if not unique:
            return []
        start = time.monotonic()
        try:
            res = subprocess.run(
                self._argv(),
                input=json.dumps(self._request(unique)),
                capture_output=True,
                text=True,
                timeout=self.timeout_s * len(unique) / self.parallel + 30,
            )
            lines = res.stdout.splitlines()
        except subprocess.TimeoutExpired:
            lines = []
        by_program: dict[str, ExecResult] = {}
        for src, line in zip(unique, lines):
            r = json.loads(line)
            by_program[src] = ExecResult(r["verdict"], r["exit_code"], r["stdout"], r["stderr"], r["duration_s"], r["feedback"])
        elapsed = time.monotonic() - start
        infra = ExecResult("infra", None, "", "sandbox batch did not report this program", elapsed)
        return [by_program.get(src, infra) for src in programs]
