"""Workspaces: overlay layers over a read-only base tree, with snapshots.

A workspace is what a multi-step task's commands see at ``/workspace`` in
the sandbox: the base tree (an "image", e.g. a repository checkout; never
written) under a stack of frozen layers, under one writable layer. Each
sandbox launch mounts that stack with overlayfs inside its own mount
namespace (``bwrap --overlay``), so nothing is mounted on the host and
nothing is left mounted when the sandbox ends.

- ``snapshot()`` freezes the writable layer (a rename) and starts a new empty
  one: O(1), whatever the size of the tree.
- ``restore(id)`` drops every layer above the snapshot and the writable one
  (renamed away, deleted in the background): O(1) too.
- ``reset()`` returns to the base tree.

Deletions are overlayfs whiteouts in the layer that made them, so a
restore brings deleted files back. At most ``max_layers`` snapshots can be
stacked (the overlay mount options must fit in one page); restore or reset
to go on.
"""

from __future__ import annotations

import shutil
import threading
import uuid
from pathlib import Path

from sandbox import tempdirs


class WorkspaceError(RuntimeError):
    pass


class Workspace:
    def __init__(self, base: str | Path | None = None, *, root: str | Path | None = None, max_layers: int = 48) -> None:
        self.base = Path(base).resolve() if base is not None else None
        if self.base is not None and not self.base.is_dir():
            raise WorkspaceError(f"workspace base {self.base} is not a directory")
        # Without a root given, the workspace owns one (removed by close, or at the latest at exit).
        self._own: tempdirs.ProcessDir | None = None
        if root:
            self.root = Path(root)
        else:
            self._own = tempdirs.ProcessDir("ws", owner=self)
            self.root = self._own.path
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_layers = max_layers
        self._empty = self.root / "e"  # the lowest layer when there is no base
        self._empty.mkdir(exist_ok=True)
        self._layers: list[str] = []  # snapshot ids, bottom to top; layer dir = root / id
        self._upper = self._fresh_upper()

    # -- layers ------------------------------------------------------------

    def _fresh_upper(self) -> Path:
        upper = self.root / ("u" + uuid.uuid4().hex[:8])
        upper.mkdir()
        (self.root / "w").mkdir(exist_ok=True)
        return upper

    def _discard(self, paths: list[Path]) -> None:
        trash = self.root / ("t" + uuid.uuid4().hex[:8])
        trash.mkdir()
        for p in paths:
            p.rename(trash / p.name)
        # The overlay work dir may hold entries of the dropped upper: start a clean one.
        work = self.root / "w"
        if work.exists():
            work.rename(trash / "w")
        threading.Thread(target=shutil.rmtree, args=(trash,), kwargs={"ignore_errors": True}, daemon=True).start()

    def snapshot(self) -> str:
        if len(self._layers) >= self.max_layers:
            raise WorkspaceError(f"workspace holds {self.max_layers} snapshots already; restore or reset first")
        sid = str(len(self._layers) + 1)
        while (self.root / sid).exists():  # ids are never reused after a restore
            sid = str(int(sid) + 1000)
        self._upper.rename(self.root / sid)
        self._layers.append(sid)
        self._upper = self._fresh_upper()
        return sid

    def restore(self, snapshot_id: str) -> None:
        if snapshot_id not in self._layers:
            raise WorkspaceError(f"unknown snapshot {snapshot_id!r}; known: {self._layers}")
        keep = self._layers.index(snapshot_id) + 1
        dropped = [self.root / sid for sid in self._layers[keep:]] + [self._upper]
        self._layers = self._layers[:keep]
        self._discard(dropped)
        self._upper = self._fresh_upper()

    def reset(self) -> None:
        dropped = [self.root / sid for sid in self._layers] + [self._upper]
        self._layers = []
        self._discard(dropped)
        self._upper = self._fresh_upper()

    @property
    def snapshots(self) -> list[str]:
        return list(self._layers)

    # -- mounting ----------------------------------------------------------

    def bwrap_args(self, dest: str = "/workspace") -> list[str]:
        lowers = [self.base or self._empty] + [self.root / sid for sid in self._layers]
        args: list[str] = []
        for lower in lowers:
            args += ["--overlay-src", str(lower)]
        (self.root / "w").mkdir(exist_ok=True)
        return args + ["--overlay", str(self._upper), str(self.root / "w"), dest]

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
        if self._own is not None:
            self._own.close()

    def __enter__(self) -> Workspace:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
