"""The sandbox's directories on the host, and the sweep that removes the ones left behind.

Every directory the sandbox makes on the host (a Sandbox's seccomp filter and
test directories, a workspace's layers, a terminal task's base tree) lies in
the temp dir (``TMPDIR``) and is named ``conveyor-sandbox-<pid>-<kind>-<random>``,
so the process that owns it can be read off its name. Usage::

    with tempdirs.temporary("term") as tmp:       # a task's: removed when the block ends
        ...
    owned = tempdirs.ProcessDir("run", owner=self)  # an object's, living as long as it
    owned.close()

How each exit removes them:

- a normal end: the ``with`` block, or the owner's ``close()``;
- an owner dropped without ``close()``: when it is garbage collected;
- the interpreter's exit: ``atexit`` (through ``weakref.finalize``);
- the exit of a forked ``multiprocessing`` child (a ``Pool``'s worker too): it
  leaves with ``os._exit`` after ``multiprocessing``'s own exit finalizers,
  past ``atexit``, so a process-lifetime directory is registered with those;
- Celery's prefork pool ends a child with ``os._exit`` right after its
  ``worker_process_shutdown`` signal and runs no finalizer: the service that
  owns a sandbox there closes it on that signal;
- a process that is killed (OOM killer, ``kill -9``, Celery's hard time limit)
  runs nothing: :func:`sweep`, run by every Sandbox at start, removes the
  directories whose owner pid no longer runs.

The sweep never removes a directory whose owner pid runs (a reused pid keeps a
dead owner's directory until that process ends too), and tolerates another
process removing the same directory first. Directories named before owners
were recorded (``conveyor-sandbox-<random>``) are removed once nothing in them
changed for ``LEGACY_MAX_AGE_S``.

What it does not handle: a temp dir shared between pid namespaces (containers
with one host ``/tmp``), where another container's live pid reads as dead here.
Give each container its own ``TMPDIR``.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
import weakref
from pathlib import Path

import structlog

from conveyor.runtime import pid_alive

log = structlog.get_logger(__name__)
PREFIX = "conveyor-sandbox-"
LEGACY_MAX_AGE_S = 3600.0
_OWNED = re.compile(re.escape(PREFIX) + r"(\d+)-")
_LEGACY = re.compile(re.escape(PREFIX) + r"[a-z0-9_]+$")  # tempfile.mkdtemp's suffix alone

# This process's live process-lifetime directories (path -> owner pid: a forked child inherits the
# parent's entries, and must not remove them), and the pid whose exit hooks are registered.
_live: dict[str, int] = {}
_hooked_pid: int | None = None


def prefix(kind: str) -> str:
    """The name prefix of this process's directories of ``kind`` (pass it to ``tempfile``)."""
    return f"{PREFIX}{os.getpid()}-{kind}-"


def owner_pid(name: str) -> int | None:
    """The pid a directory's name records; None for other names (the legacy one included)."""
    m = _OWNED.match(name)
    return int(m.group(1)) if m else None


def temporary(kind: str) -> tempfile.TemporaryDirectory:
    """A directory for one ``with`` block."""
    return tempfile.TemporaryDirectory(prefix=prefix(kind))


def _remove(path: str, pid: int) -> None:
    _live.pop(path, None)
    if os.getpid() == pid:  # never from a forked child that inherited the entry
        shutil.rmtree(path, ignore_errors=True)


def _remove_all_of_this_process() -> None:
    for path, pid in list(_live.items()):
        _remove(path, pid)


def _hook_process_exit() -> None:
    """Register the removal of this process's directories with ``multiprocessing``'s exit finalizers
    (once per process: a forked child starts with an empty registry)."""
    global _hooked_pid
    if _hooked_pid == os.getpid():
        return
    _hooked_pid = os.getpid()
    import multiprocessing.util

    multiprocessing.util.Finalize(None, _remove_all_of_this_process, exitpriority=100)


class ProcessDir:
    """A directory that lives as long as ``owner``: removed by :meth:`close`, when ``owner`` is
    collected, or when the process exits (see the module's docstring for each exit)."""

    def __init__(self, kind: str, owner: object) -> None:
        _hook_process_exit()
        self.path = Path(tempfile.mkdtemp(prefix=prefix(kind)))
        _live[str(self.path)] = os.getpid()
        self._finalizer = weakref.finalize(owner, _remove, str(self.path), os.getpid())

    def close(self) -> None:
        self._finalizer()


def _last_change(path: str) -> float:
    """The latest mtime of the directory and its entries (a cold Sandbox adds a batch directory to
    its own, a warm one writes into ``warm-tests``)."""
    newest = os.stat(path, follow_symlinks=False).st_mtime
    with os.scandir(path) as entries:
        for entry in entries:
            try:
                newest = max(newest, entry.stat(follow_symlinks=False).st_mtime)
            except FileNotFoundError:
                continue
    return newest


def _stale(entry: os.DirEntry) -> bool:
    pid = owner_pid(entry.name)
    if pid is not None:
        return not pid_alive(pid)
    if _LEGACY.match(entry.name):
        return time.time() - _last_change(entry.path) > LEGACY_MAX_AGE_S
    return False


def sweep(tmpdir: str | Path | None = None) -> list[str]:
    """Remove the sandbox directories in ``tmpdir`` (default: the temp dir) whose owner is gone;
    returns their names. Errors other than a lost race are logged, never raised: a sweep must not
    stop a sandbox from starting."""
    root = str(tmpdir) if tmpdir is not None else tempfile.gettempdir()
    removed: list[str] = []
    try:
        with os.scandir(root) as it:
            entries = [e for e in it if e.name.startswith(PREFIX)]
    except OSError as exc:
        log.warning("sandbox_sweep_failed", dir=root, error=str(exc))
        return removed
    for entry in entries:
        try:
            if not entry.is_dir(follow_symlinks=False) or not _stale(entry):
                continue
        except FileNotFoundError:  # another process removed it first
            continue
        except OSError as exc:
            log.warning("sandbox_sweep_failed", dir=entry.path, error=str(exc))
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        if os.path.lexists(entry.path):
            log.warning("sandbox_sweep_incomplete", dir=entry.path)
        else:
            removed.append(entry.name)
    if removed:
        log.info("sandbox_dirs_swept", dir=root, count=len(removed))
    return removed
