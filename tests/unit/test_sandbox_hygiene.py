"""The sandbox leaves no directory behind on the host, and shows a task only the image directories
the operator allowed (``sandbox/tempdirs.py``, ``sandbox/images.py``)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import ROOT, open_sandbox, service_unavailable
from pydantic import ValidationError

from conveyor.config import RewardConfig
from conveyor.contracts import Task, VerifierSpec
from sandbox import tempdirs
from sandbox.images import ImageNotAllowed, normalise_roots, resolve_image


@pytest.fixture
def tmpdir_(tmp_path, monkeypatch) -> Path:
    """A private temp dir for everything ``tempfile`` makes in this test (other runs share /tmp)."""
    d = tmp_path / "tmp"
    d.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(d))
    monkeypatch.setenv("TMPDIR", str(d))
    return d


def sandbox_dirs(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name.startswith(tempdirs.PREFIX))


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # reaped: the pid runs nothing now
    return proc.pid


def make(d: Path, name: str, age_s: float = 0.0) -> Path:
    p = d / name
    (p / "warm-tests" / "abc").mkdir(parents=True)
    (p / "seccomp.bpf").write_bytes(b"x")
    if age_s:
        t = time.time() - age_s
        for q in (p / "warm-tests" / "abc", p / "warm-tests", p / "seccomp.bpf", p):
            os.utime(q, (t, t))
    return p


# -- the sweep -------------------------------------------------------------


def test_sweep_removes_a_dead_owners_dir_and_keeps_a_live_ones(tmpdir_):
    dead = make(tmpdir_, f"conveyor-sandbox-{dead_pid()}-run-abc")
    mine = make(tmpdir_, f"conveyor-sandbox-{os.getpid()}-run-xyz")
    parent = make(tmpdir_, f"conveyor-sandbox-{os.getppid()}-ws-xyz")
    other = make(tmpdir_, "conveyor-other-1-run-abc", age_s=7200)
    assert tempdirs.sweep() == [dead.name]
    assert not dead.exists() and mine.exists() and parent.exists() and other.exists()


def test_sweep_removes_legacy_dirs_only_when_nothing_changed_for_an_hour(tmpdir_):
    old = make(tmpdir_, "conveyor-sandbox-a66zbykx", age_s=2 * 3600)
    fresh = make(tmpdir_, "conveyor-sandbox-q1w2e3r4")
    busy = make(tmpdir_, "conveyor-sandbox-z9y8x7w6", age_s=2 * 3600)
    (busy / "warm-tests" / "new").mkdir()  # a warm sandbox of the old version wrote its tests just now
    assert tempdirs.sweep(tmpdir_) == [old.name]
    assert fresh.exists() and busy.exists()


def test_sweep_survives_another_process_removing_the_dir_first(tmpdir_, monkeypatch):
    gone = make(tmpdir_, "conveyor-sandbox-123-run-abc")
    also = make(tmpdir_, "conveyor-sandbox-124-run-abc")

    def racing_pid_alive(pid: int) -> bool:  # the other sweeper wins between listing and removal
        shutil.rmtree(gone, ignore_errors=True)
        shutil.rmtree(also / "warm-tests", ignore_errors=True)
        return False

    monkeypatch.setattr(tempdirs, "pid_alive", racing_pid_alive)
    tempdirs.sweep()
    assert sandbox_dirs(tmpdir_) == []


def test_a_killed_process_leaves_its_dir_and_the_next_sweep_removes_it(tmpdir_):
    code = (
        "import os, signal; from sandbox import tempdirs\n"
        "class Owner: pass\n"
        "o = Owner(); d = tempdirs.ProcessDir('run', owner=o)\n"
        "print(os.getpid(), d.path, flush=True); os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    pid, path = proc.stdout.split()
    left = Path(path)
    assert left.parent == tmpdir_ and left.is_dir()  # nothing runs on SIGKILL
    assert tempdirs.owner_pid(left.name) == int(pid)
    assert tempdirs.sweep() == [left.name] and not left.exists()


def run_fresh(code: str, tmpdir: Path) -> str:
    """``code`` in a fresh interpreter: forking from the test process would also fork whatever
    earlier tests left in it (threads, broker connections whose after-fork hooks block)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), TMPDIR=str(tmpdir))
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


FORKS = """
import multiprocessing, os
from sandbox import tempdirs

class Owner:
    pass

kept = []

def make_and_keep(_=0):
    o = Owner()
    kept.append((o, tempdirs.ProcessDir("run", owner=o)))  # still referenced when the child exits
    return os.getpid()

if __name__ == "__main__":
    ctx = multiprocessing.get_context("fork")
    child = ctx.Process(target=make_and_keep)
    child.start()
    child.join(30)
    assert child.exitcode == 0
    with ctx.Pool(1, maxtasksperchild=1) as pool:
        pids = pool.map(make_and_keep, range(3), chunksize=1)
        pool.close()
        pool.join()
    print(len(set(pids)))
"""


def test_a_forked_child_removes_its_dir_at_exit(tmpdir_):
    """Forked children exit with os._exit, past atexit; a recycled pool worker too."""
    assert run_fresh(FORKS, tmpdir_).split() == ["3"]  # three pool workers, one after the other
    assert sandbox_dirs(tmpdir_) == []


FORK_KEEPS_PARENTS = """
import gc, os
from sandbox import tempdirs

class Owner:
    pass

a, b = Owner(), Owner()
da, db = tempdirs.ProcessDir("run", owner=a), tempdirs.ProcessDir("ws", owner=b)
assert da.path.name.startswith(f"conveyor-sandbox-{os.getpid()}-run-")
pid = os.fork()
if pid == 0:  # a forked child dropping what it inherited must leave the parent's dirs alone
    da.close()
    os._exit(0)
os.waitpid(pid, 0)
assert da.path.is_dir()
da.close()
del b
gc.collect()
print(int(db.path.exists()))
"""


def test_a_process_dir_goes_with_close_or_its_owner_and_not_in_a_forked_child(tmpdir_):
    assert run_fresh(FORK_KEEPS_PARENTS, tmpdir_).split() == ["0"]
    assert sandbox_dirs(tmpdir_) == []


# -- a real sandbox --------------------------------------------------------


@pytest.mark.parametrize("warm", [False, True])
def test_a_sandbox_run_leaves_no_dir_behind(tmpdir_, warm):
    sb = open_sandbox(timeout_s=2.0, parallel=1, warm=warm)
    try:
        assert sandbox_dirs(tmpdir_) == [sb._dir.name]
        assert tempdirs.owner_pid(sb._dir.name) == os.getpid()
        [r] = sb.run_batch(["print('ok')"])
        assert r.verdict == "pass"
    finally:
        sb.close()
    assert sandbox_dirs(tmpdir_) == []


def test_a_sandbox_that_fails_to_start_leaves_no_dir_behind(tmpdir_, monkeypatch):
    from conveyor.binaries import BinaryMissing, bwrap_binary
    from sandbox import runner

    try:
        bwrap_binary()
    except BinaryMissing as exc:
        service_unavailable(f"bubblewrap: {exc}")

    def broken() -> bytes:
        raise RuntimeError("no libseccomp")

    monkeypatch.setattr(runner, "filter_bpf", broken)
    with pytest.raises(runner.SandboxUnavailable, match="seccomp") as failure:
        runner.Sandbox(parallel=1)
    # removed at once, not when the half-built sandbox (held by the traceback) is collected
    assert failure.tb is not None and sandbox_dirs(tmpdir_) == []


def test_a_sandbox_start_sweeps_a_dead_owners_dir(tmpdir_):
    dead = make(tmpdir_, f"conveyor-sandbox-{dead_pid()}-run-abc")
    sb = open_sandbox(timeout_s=2.0, parallel=1)
    sb.close()
    assert not dead.exists()


# -- images ----------------------------------------------------------------


@pytest.fixture
def images(tmp_path) -> SimpleNamespace:
    root = tmp_path / "images"
    (root / "repo" / "src").mkdir(parents=True)
    (root / "repo" / "README").write_text("hi")
    outside = tmp_path / "secret"
    outside.mkdir()
    (root / "escape").symlink_to(outside)
    (root / "inner").symlink_to(root / "repo")
    return SimpleNamespace(root=root, outside=outside, roots=normalise_roots([root]))


def test_an_image_inside_a_root_is_accepted(images):
    repo = Path(os.path.realpath(images.root / "repo"))
    assert resolve_image(str(images.root / "repo"), images.roots) == repo
    assert resolve_image(str(images.root / "inner"), images.roots) == repo  # a symlink that stays inside
    assert resolve_image(str(images.root / "inner" / "src"), images.roots) == repo / "src"


@pytest.mark.parametrize(
    "name",
    ["{outside}", "{root}/../secret", "{root}/repo/../../secret", "{root}/repo/../repo", "repo", "{root}/escape", "/etc", "/"],
)
def test_an_image_outside_the_roots_is_refused(images, name):
    image = name.format(root=images.root, outside=images.outside)
    with pytest.raises(ImageNotAllowed, match=r"verifier\.data\.image .* not allowed.*reward\.image_roots \("):
        resolve_image(image, images.roots)


def test_no_roots_means_no_image_at_all(images):
    with pytest.raises(ImageNotAllowed, match=r"reward\.image_roots is empty"):
        resolve_image(str(images.root / "repo"), ())
    with pytest.raises(ImageNotAllowed, match="not a directory"):
        resolve_image(str(images.root / "repo" / "README"), images.roots)


def test_image_roots_in_the_config():
    assert RewardConfig().image_roots == []
    assert RewardConfig(image_roots=["/srv/images"]).image_roots == ["/srv/images"]
    for bad in (["images"], ["/"], ["//."], ["/srv/../etc"]):
        with pytest.raises(ValidationError, match="image root"):
            RewardConfig(image_roots=bad)


def _terminal(image: str) -> Task:
    data = {"image": image, "checks": "import os\nassert os.path.exists('/workspace/README')\n", "style": "assert"}
    return Task(task_id="t", run_id="r", prompt="p", verifier=VerifierSpec(kind="terminal", data=data))


def test_a_task_naming_a_disallowed_image_scores_error_with_the_reason(images):
    from tasks.verifiers import score_batch

    not_run = SimpleNamespace(image_roots=images.roots)  # refused before anything runs in a sandbox
    a, b = score_batch(not_run, [(_terminal("/etc"), "true"), (_terminal(str(images.root / "escape")), "true")])
    for v in (a, b):
        assert (v.reward, v.verdict) == (0.0, "error")
        assert "verifier.data.image" in v.feedback.message and str(images.roots[0]) in v.feedback.message


def test_a_task_on_an_allowed_image_runs_on_it(images):
    from sandbox.runner import Sandbox, SandboxUnavailable
    from tasks.verifiers import score_batch

    try:
        sb = Sandbox.from_config(RewardConfig(image_roots=[str(images.root)]), parallel=1)
    except SandboxUnavailable as exc:
        service_unavailable(f"bubblewrap sandbox: {exc}")
    try:
        [ok, refused] = score_batch(sb, [(_terminal(str(images.root / "repo")), "cat README\n"), (_terminal("/etc"), "true")])
    finally:
        sb.close()
    assert ok.verdict == "pass", ok.feedback
    assert refused.verdict == "error"
