"""A machine for environments that need one: the episode's own workspace in the sandbox.

An environment that sets ``machine = True`` gets a :class:`Machine` as the second argument of
``reset(task, machine)``. Its workspace is built as a terminal task's is (``workspace_base``):
the task's ``data.image`` (a directory under the sandbox's image roots) and
``data.files`` (path -> text), seen at ``/workspace``, changed only through the overlay layers of
``sandbox/workspace.py``. Commands run in the bubblewrap sandbox under the reward tier's limits
(time, memory, output, no network), one launch each, and the workspace persists across the
episode's steps.

Around every step the environment's driver (``tasks/environments.py``) snapshots the workspace
and, when the step reports ``failed`` (or raises), restores it, so a step that went wrong leaves
nothing half-changed. Snapshots are O(1) overlay layers; an episode keeps at most
``MAX_STEPS`` of them, which bounds a machine environment's episode length.

The rollout worker runs the episode on its tool sandbox; the reward service replays the actions
on a fresh machine from the same task, so an environment's reward must follow from the task and
the actions alone (the sandbox's clock and PIDs are not inputs).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from conveyor.contracts import Task
from sandbox import tempdirs
from sandbox.images import ImageNotAllowed, resolve_image
from sandbox.runner import Job, Sandbox
from sandbox.workspace import Workspace
from tasks.verdict import VerifierError

MAX_STEPS = 48  # the workspace's overlay layers: the mount options must fit in one page


def workspace_base(task: Task, tmp: Path, image_roots: Sequence[str] = ()) -> Path:
    """A terminal task's or a machine environment's workspace base tree: ``data.image`` (which must
    lie inside ``image_roots``, ``sandbox/images.py``) under ``data.files``."""
    data = task.verifier.data
    image, files = data.get("image"), data.get("files") or {}
    if image:
        try:
            image = resolve_image(image, image_roots)
        except ImageNotAllowed as exc:
            raise VerifierError(f"task {task.task_id}: {exc}") from None
    if image and not files:
        return image  # read-only lower layer: never copied, never written
    base = tmp / "base"
    if image:
        shutil.copytree(image, base, symlinks=True)
    else:
        base.mkdir()
    for rel, content in files.items():
        path = (base / rel).resolve()
        if not str(path).startswith(str(base.resolve()) + "/"):
            raise VerifierError(f"task {task.task_id}: file {rel!r} is outside the workspace")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
    return base


@dataclass(frozen=True)
class CommandResult:
    exit_code: int | None  # None: the sandbox ended the command (verdict says why)
    stdout: str
    stderr: str
    verdict: str  # the sandbox's: "pass" when it exited by itself, else timeout, memory, output_limit, infra

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.verdict not in ("timeout", "memory", "output_limit", "infra")


class Machine:
    def __init__(self, sandbox: Sandbox, task: Task) -> None:
        self.sandbox = sandbox
        self._tmp: tempfile.TemporaryDirectory[str] = tempdirs.temporary("machine")
        try:
            base = workspace_base(task, Path(self._tmp.name), sandbox.image_roots)
            self.workspace = Workspace(base, root=Path(self._tmp.name) / "ws", max_layers=MAX_STEPS)
        except BaseException:
            self._tmp.cleanup()
            raise

    def run(self, command: str, *, errexit: bool = False) -> CommandResult:
        """``command`` under ``/bin/sh -c`` (``-e`` with ``errexit``) with ``/workspace`` as the
        episode left it."""
        shell = ("/bin/sh", "-e", "-c") if errexit else ("/bin/sh", "-c")
        (res,) = self.sandbox.run([Job(kind="command", argv=(*shell, command))], self.workspace)
        return CommandResult(res.exit_code, res.stdout, res.stderr, str(res.verdict))

    def snapshot(self) -> str:
        return self.workspace.snapshot()

    def restore(self, snapshot_id: str) -> None:
        self.workspace.restore(snapshot_id)

    def close(self) -> None:
        self.workspace.close()
        self._tmp.cleanup()
