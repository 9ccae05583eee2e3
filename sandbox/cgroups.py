"""Memory and process-count limits for a sandbox batch through cgroups.

Both hierarchies are supported and detected at start:

- **v2** (most clusters): one directory under the service's own cgroup with
  ``memory.max``, ``memory.swap.max = 0`` and ``pids.max``; the parent must
  delegate the ``memory`` and ``pids`` controllers (``cgroup.subtree_control``).
- **v1** (these machines): a directory in the ``memory`` and in the ``pids``
  hierarchy, under the service's own cgroup in each, with
  ``memory.limit_in_bytes`` (and ``memsw`` when swap accounting is on) and
  ``pids.max``.

A batch's cgroup is created before its sandbox starts, the sandbox process is
moved into it before it executes bwrap (so every descendant is accounted),
and it is emptied and removed when the batch ends; :func:`sweep` removes
directories left by a crashed service.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import structlog

from conveyor.runtime import pid_alive

log = structlog.get_logger(__name__)
ROOT = Path("/sys/fs/cgroup")
PREFIX = "conveyor-sbx-"


class CgroupsUnavailable(RuntimeError):
    pass


def _own_path(controller: str | None) -> str:
    """This process's cgroup path in a v1 hierarchy (controller) or in v2 (None)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controller is None and controllers == "":
            return path
        if controller is not None and controller in controllers.split(","):
            return path
    raise CgroupsUnavailable(f"this process is in no {controller or 'v2'} cgroup")


def detect() -> str | None:
    """'v2', 'v1', or None when neither offers writable memory and pids controllers."""
    if (ROOT / "cgroup.controllers").exists():
        try:
            parent = ROOT / _own_path(None).lstrip("/")
            ctl = set((parent / "cgroup.controllers").read_text().split())
        except (OSError, CgroupsUnavailable):
            return None
        return "v2" if {"memory", "pids"} <= ctl and os.access(parent, os.W_OK) else None
    try:
        ok = all(os.access(ROOT / c / _own_path(c).lstrip("/"), os.W_OK) for c in ("memory", "pids"))
    except (OSError, CgroupsUnavailable):
        return None
    return "v1" if ok else None


@dataclass
class Cgroup:
    version: str
    dirs: list[Path]  # v2: [dir]; v1: [memory dir, pids dir]

    @property
    def procs_files(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self.dirs]

    def _pids(self) -> list[int]:
        pids: set[int] = set()
        for f in self.procs_files:
            try:
                pids.update(int(p) for p in Path(f).read_text().split())
            except OSError:
                pass
        return sorted(pids)

    def remove(self) -> None:
        """Kill whatever is left inside, then remove the directories."""
        for _ in range(50):
            pids = self._pids()
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.01)
        for d in self.dirs:
            for _ in range(50):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:  # busy for a moment while the last process exits
                    time.sleep(0.01)
            else:
                log.warning("cgroup_not_removed", path=str(d))


class CgroupFactory:
    def __init__(self, version: str) -> None:
        self.version = version
        if version == "v2":
            self.parents = [ROOT / _own_path(None).lstrip("/")]
        else:
            self.parents = [ROOT / c / _own_path(c).lstrip("/") for c in ("memory", "pids")]

    def create(self, memory_bytes: int, pids: int) -> Cgroup:
        name = f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"  # the owner's pid: see sweep()
        dirs = [p / name for p in self.parents]
        for d in dirs:
            d.mkdir()
        cg = Cgroup(self.version, dirs)
        try:
            if self.version == "v2":
                (dirs[0] / "memory.max").write_text(str(memory_bytes))
                if (dirs[0] / "memory.swap.max").exists():
                    (dirs[0] / "memory.swap.max").write_text("0")
                (dirs[0] / "pids.max").write_text(str(pids))
            else:
                (dirs[0] / "memory.limit_in_bytes").write_text(str(memory_bytes))
                memsw = dirs[0] / "memory.memsw.limit_in_bytes"
                if memsw.exists():
                    try:
                        memsw.write_text(str(memory_bytes))
                    except OSError:
                        pass
                (dirs[1] / "pids.max").write_text(str(pids))
        except OSError:
            cg.remove()
            raise
        return cg

    def sweep(self) -> int:
        """Remove cgroups left behind by services that died (their owner pid is gone);
        other live sandboxes' cgroups (sibling pool processes) are left alone."""
        removed = 0
        for parent in self.parents:
            for d in parent.glob(PREFIX + "*"):
                owner = d.name[len(PREFIX) :].split("-")[0]
                if owner.isdigit() and pid_alive(int(owner)):
                    continue
                Cgroup(self.version, [d]).remove()
                removed += not d.exists()
        return removed
