"""cgroup handling on this host (v1 here; v2 on most clusters)."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from sandbox import cgroups


@pytest.fixture
def factory():
    version = cgroups.detect()
    if version is None:
        pytest.skip("no writable memory+pids cgroup controllers on this host")
    return cgroups.CgroupFactory(version)


def test_limits_are_written_and_the_cgroup_removed(factory):
    cg = factory.create(memory_bytes=64 << 20, pids=10)
    try:
        mem = cg.dirs[0] / ("memory.max" if cg.version == "v2" else "memory.limit_in_bytes")
        assert int(mem.read_text()) == 64 << 20
        pids = cg.dirs[-1] / "pids.max"
        assert pids.read_text().strip() == "10"
        proc = subprocess.Popen(["/bin/sh", "-c", 'for f in "$@"; do echo $$ > "$f"; done; exec sleep 30', "sh", *cg.procs_files])
        for _ in range(100):
            if cg._pids():
                break
            time.sleep(0.05)
        assert proc.pid in cg._pids()
    finally:
        cg.remove()
    assert proc.wait(5) == -9  # what was left inside was killed
    assert not any(d.exists() for d in cg.dirs)


def test_sweep_removes_only_dead_owners_cgroups(factory):
    mine = factory.create(memory_bytes=64 << 20, pids=10)
    child = subprocess.Popen(["/bin/true"])
    child.wait()
    dead_pid = child.pid
    orphans = [p / f"{cgroups.PREFIX}{dead_pid}-deadbeef0000" for p in factory.parents]
    for d in orphans:
        d.mkdir()
    try:
        factory.sweep()
        assert not any(d.exists() for d in orphans)
        assert all(d.exists() for d in mine.dirs)
        assert str(os.getpid()) in mine.dirs[0].name
    finally:
        mine.remove()
        for d in orphans:
            if d.exists():
                d.rmdir()
