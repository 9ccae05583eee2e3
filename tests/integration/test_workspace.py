"""Workspace snapshots and rollback on a tree of about 2,000 files."""

from __future__ import annotations

import json
import time

import pytest
from conftest import open_sandbox

HASH_TREE = (
    "import hashlib, json, os\nout = {}\n"
    "for d, dirs, files in os.walk('/workspace'):\n"
    "    for f in files:\n"
    "        p = os.path.join(d, f)\n"
    "        out[os.path.relpath(p, '/workspace')] = hashlib.sha256(open(p, 'rb').read()).hexdigest()[:16]\n"
    "    for s in dirs:\n"
    "        out[os.path.relpath(os.path.join(d, s), '/workspace') + '/'] = 'dir'\n"
    "print(json.dumps(out, sort_keys=True))\n"
)


@pytest.fixture(scope="module")
def sandbox():
    sb = open_sandbox(timeout_s=10.0, max_output_bytes=1 << 20)
    yield sb
    sb.close()


@pytest.fixture
def base(tmp_path):
    root = tmp_path / "base"
    for i in range(2000):
        p = root / f"pkg{i % 20}" / f"mod{i}.py"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(f"VALUE = {i}\n")
    return root


def tree(sandbox, ws):
    from sandbox.runner import Job

    [r] = sandbox.run([Job(HASH_TREE)], ws)
    assert r.verdict == "pass", r
    return json.loads(r.stdout)


def sh(sandbox, ws, script):
    from sandbox.runner import Job

    [r] = sandbox.run([Job(kind="command", argv=("/bin/sh", "-e", "-c", script))], ws)
    assert r.verdict == "pass", r
    return r


def test_snapshot_restore_reset_on_2000_files(sandbox, base, tmp_path):
    from sandbox.workspace import Workspace, WorkspaceError

    with Workspace(base, root=tmp_path / "ws") as ws:
        original = tree(sandbox, ws)
        assert sum(1 for k in original if k.endswith(".py")) == 2000
        # Step 1: edits, deletions, new files and a new directory.
        sh(sandbox, ws, "for i in $(seq 0 20 1999); do echo 'VALUE = -1' > pkg0/mod$i.py 2>/dev/null || true; done;"
                        " rm -f pkg1/mod1*.py; rm -rf pkg2; mkdir -p new/deep; for i in $(seq 1 100); do echo $i > new/deep/f$i; done;"
                        " echo edited >> pkg3/mod3.py")  # fmt: skip
        step1 = tree(sandbox, ws)
        assert step1 != original and "pkg2/" not in step1 and "new/deep/f100" in step1
        t0 = time.perf_counter()
        s1 = ws.snapshot()
        snapshot_ms = (time.perf_counter() - t0) * 1000
        # Step 2 breaks everything.
        sh(sandbox, ws, "rm -rf pkg* new; echo broken > README")
        assert tree(sandbox, ws) == {"README": tree(sandbox, ws)["README"]}
        s2 = ws.snapshot()
        sh(sandbox, ws, "echo more > more.txt")
        t0 = time.perf_counter()
        ws.restore(s1)
        restore_ms = (time.perf_counter() - t0) * 1000
        assert tree(sandbox, ws) == step1  # deletions came back, later files are gone
        with pytest.raises(WorkspaceError):
            ws.restore(s2)  # dropped by the restore to s1
        ws.reset()
        assert tree(sandbox, ws) == original
    assert (base / "pkg2" / "mod2.py").read_text() == "VALUE = 2\n"  # the base tree was never written
    print(f"snapshot {snapshot_ms:.2f} ms, restore {restore_ms:.2f} ms")  # figures: bench/sandbox.py
