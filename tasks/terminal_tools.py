"""Tool turns in a sandbox workspace that persists across the turns of an episode.

For a ``terminal`` task with ``max_turns > 1`` every assistant turn is a tool
call: a JSON object ``{"name": "shell", "arguments": {"command": ...}}`` (or
``write_file`` with ``path`` and ``content``), or plain shell text. The call
runs in the bubblewrap sandbox on the episode's own overlay workspace
(``sandbox/workspace.py``), which lives as long as the episode: files written
in turn 1 are there in turn 3. Before each call the workspace is snapshotted;
a call that fails (non-zero exit, timeout, memory) is rolled back, so a
broken command never leaves the workspace half-changed, and the model reads
what happened as the observation (exit code, output tails, "rolled back").
The episode ends at ``max_turns`` or when the model sends an empty turn or
``done``.

What the reward service judges is the episode's *net script*: the calls that
were kept, in order (``conveyor.contracts.tool_episode_script``). Replayed
from the task's base in a fresh workspace they reproduce the final state, so
the bridge scores tool episodes with the same stateless terminal verifier as
one-shot attempts.
"""

from __future__ import annotations

import json
import shlex

from conveyor.contracts import Task, ToolCall
from sandbox.runner import Sandbox
from tasks.machine import Machine
from tasks.verifiers import code_of

OUTPUT_TAIL = 400
DONE = {"", "done", "exit"}


def parse_turn(text: str) -> ToolCall | None:
    """The tool call in an assistant turn; None when the model is done."""
    body = code_of(text).strip()
    if body.lower() in DONE:
        return None
    try:
        obj = json.loads(body)
    except ValueError:
        obj = None
    if isinstance(obj, dict) and obj.get("name") in ("shell", "write_file") and isinstance(obj.get("arguments"), dict):
        return ToolCall(name=obj["name"], arguments=dict(obj["arguments"]))
    return ToolCall(name="shell", arguments={"command": body})


def as_command(call: ToolCall) -> str:
    """A call as one shell command (what the net script replays)."""
    if call.name == "write_file":
        path, content = str(call.arguments.get("path", "")), str(call.arguments.get("content", ""))
        return f'mkdir -p -- "$(dirname -- {shlex.quote(path)})" && printf %s {shlex.quote(content)} > {shlex.quote(path)}'
    return str(call.arguments.get("command", ""))


class ToolEpisode:
    """One episode's workspace (a :class:`tasks.machine.Machine`): run calls, snapshot before
    each, roll back failures."""

    def __init__(self, sandbox: Sandbox, task: Task) -> None:
        self.machine = Machine(sandbox, task)
        self.kept: list[str] = []

    def call(self, call: ToolCall) -> tuple[str, bool]:
        """Run ``call``; return (observation text, kept)."""
        command = as_command(call)
        snap = self.machine.snapshot()
        result = self.machine.run(command, errexit=True)
        if result.ok:
            self.kept.append(command)
        else:
            self.machine.restore(snap)
        lines = [f"[exit {result.exit_code if result.exit_code is not None else result.verdict}]"]
        if result.stdout:
            lines.append(result.stdout[-OUTPUT_TAIL:].rstrip("\n"))
        if result.stderr:
            lines.append(result.stderr[-OUTPUT_TAIL:].rstrip("\n"))
        if not result.ok:
            lines.append("[rolled back]")
        return "\n" + "\n".join(lines) + "\n", result.ok

    def close(self) -> None:
        self.machine.close()
