"""CAD parts built through tool calls (the built-in ``cad`` environment, ``tasks/cad.py``).

Each problem is a part described in words (plates with hole patterns, washers, L-brackets, in a
range of sizes) with the reference calls that build it; the target (volume, bounding box,
through-holes) is what those calls make, so every problem is solvable by construction. The model
sees the tools as the task's ``tools`` and the target in the prompt, and works over up to
``MAX_TURNS`` turns. The split is fixed by a hash of the id (about 20 % held out).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import msgspec

from conveyor.contracts import Task
from tasks import cad
from tasks.suites import split_of, suite_task

SUITE = "cad"
MAX_TURNS = 10


@dataclass(frozen=True)
class Problem:
    id: str
    difficulty: int  # 1: one extrusion; 2: with holes cut; 3: several solids and a boolean
    description: str
    calls: tuple[dict, ...]

    @property
    def split(self) -> str:
        return split_of(SUITE, self.id)

    @property
    def reference(self) -> str:
        """The reference episode as the reward service gets an episode: its turns, a JSON list."""
        return json.dumps([json.dumps(c) for c in self.calls] + ["done"])

    @property
    def wrong(self) -> str:
        """An episode that sketches the part and never makes a solid (reward 0)."""
        return json.dumps([json.dumps(c) for c in self.calls if c["name"] not in ("extrude", "boolean")] + ["done"])


def _washer(outer: float, inner: float, t: float) -> list[dict]:
    return [{"name": "new_sketch", "arguments": {"name": "s"}},
            {"name": "add_circle", "arguments": {"sketch": "s", "radius": outer}},
            {"name": "add_circle", "arguments": {"sketch": "s", "radius": inner, "cut": True}},
            {"name": "extrude", "arguments": {"sketch": "s", "height": t, "name": "washer"}}]  # fmt: skip


def _bracket(w: float, d: float, t: float, h: float) -> list[dict]:
    return [*cad.plate_calls(w, d, t, []),
            {"name": "new_sketch", "arguments": {"name": "w"}},
            {"name": "add_rect", "arguments": {"sketch": "w", "width": t, "height": d, "x": -(w - t) / 2}},
            {"name": "extrude", "arguments": {"sketch": "w", "height": h, "name": "wall"}},
            {"name": "boolean", "arguments": {"op": "union", "a": "part", "b": "wall", "name": "bracket"}}]  # fmt: skip


def problems() -> list[Problem]:
    out = []
    for w, d, t in ((20, 10, 2), (30, 20, 3), (40, 20, 5), (50, 30, 4)):
        out.append(Problem(f"block_{w}x{d}x{t}", 1, f"a solid block {w} x {d} x {t}", tuple(cad.plate_calls(w, d, t, []))))
        holes = [(-w / 4, 0, d / 8), (w / 4, 0, d / 8)]
        out.append(Problem(f"plate_{w}x{d}x{t}_2holes", 2,
                           f"a {w} x {d} x {t} plate with two holes of radius {d / 8:g} at x = {-w / 4:g} and x = {w / 4:g}",
                           tuple(cad.plate_calls(w, d, t, holes))))  # fmt: skip
        corners = [(sx * w / 3, sy * d / 3, d / 10) for sx in (-1, 1) for sy in (-1, 1)]
        out.append(Problem(f"plate_{w}x{d}x{t}_4holes", 2,
                           f"a {w} x {d} x {t} plate with four holes of radius {d / 10:g} at x = ±{w / 3:g}, y = ±{d / 3:g}",
                           tuple(cad.plate_calls(w, d, t, corners))))  # fmt: skip
        out.append(Problem(f"bracket_{w}x{d}x{t}", 3,
                           f"an L-bracket: a {w} x {d} x {t} base and a {t} x {d} x {w / 2:g} wall standing on its left edge",
                           tuple(_bracket(w, d, t, w / 2))))  # fmt: skip
    for outer, inner, t in ((10, 4, 2), (8, 5, 1), (15, 6, 3)):
        out.append(Problem(f"washer_{outer}_{inner}_{t}", 2, f"a washer of outer radius {outer}, inner radius {inner}, {t} thick",
                           tuple(_washer(outer, inner, t))))  # fmt: skip
    return out


def to_task(p: Problem, run_id: str, group_size: int, index: int) -> Task:
    base = cad.task(p.id, run_id, p.description, list(p.calls), max_turns=MAX_TURNS, group_size=group_size)
    task = suite_task(SUITE, p, run_id, group_size, index, verifier=base.verifier, max_tokens=96, prompt=base.prompt)
    return msgspec.structs.replace(task, tools=cad.TOOLS, max_turns=MAX_TURNS)
