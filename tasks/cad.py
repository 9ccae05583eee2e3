"""A CAD-style environment: the model builds a part through JSON tool calls, and the reward checks the
solid it made.

Every assistant turn is one call, ``{"name": TOOL, "arguments": {...}}`` (a fenced code block
around it is fine), validated against the tool's JSON Schema (:data:`TOOLS`, which tasks carry so
the chat template shows them) and then executed on the episode's model:

- ``new_sketch`` names an empty 2D sketch; ``add_rect`` and ``add_circle`` add a shape to it, or
  cut one from it (``"cut": true``), centred at ``x``, ``y``;
- ``extrude`` makes a named solid of a sketch, ``height`` tall from ``z``;
- ``boolean`` makes a solid of two others (``union``, ``difference``, ``intersection``);
- ``done`` (or an empty turn, or ``done``) ends the episode.

The part is the last solid made. After every call the observation reports it (volume, bounding
box, through-holes) or why the call was refused; a refused call changes nothing. The geometry is
Manifold's (``manifold3d``: exact mesh booleans, volume, genus as the count of through-holes).

The reward compares the part with the task's target (``verifier.data.target``: ``volume``,
``bbox`` as three extents, ``holes``): the fraction of the three within ``tolerance`` (relative,
default 0.02; holes exactly). It is deterministic given the task and the calls, so the reward
service replays an episode to score it (``tasks/environments.py``). A task::

    {"verifier": {"kind": "environment", "data": {"environment": "cad",
     "target": {"volume": 3874.8, "bbox": [40, 20, 5], "holes": 2}}}, "tools": cad.TOOLS, "max_turns": 8}

:func:`task` builds one from a reference part's calls; the ``cad`` suite (``tasks/suites/cad.py``) has
nineteen.
"""

from __future__ import annotations

import json
from typing import Any

from conveyor.contracts import Task, VerifierSpec
from tasks.environments import Step

SEGMENTS = 64  # polygon sides of a circle: the same in every episode and in every target
MAX_SIZE = 1e4  # no dimension beyond this (a model asking for a 1e300 box gets an error, not a hang)
MAX_OBJECTS = 64

_NUM = {"type": "number", "minimum": -MAX_SIZE, "maximum": MAX_SIZE}
_POS = {"type": "number", "exclusiveMinimum": 0, "maximum": MAX_SIZE}
_NAME = {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,32}$"}


def _tool(name: str, description: str, properties: dict, required: list[str]) -> dict[str, Any]:
    schema = {"type": "object", "properties": properties, "required": required, "additionalProperties": False}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": schema}}


TOOLS = [
    _tool("new_sketch", "Start an empty 2D sketch.", {"name": _NAME}, ["name"]),
    _tool("add_rect", "Add a rectangle centred at (x, y) to a sketch, or cut it out (cut: true).",
          {"sketch": _NAME, "width": _POS, "height": _POS, "x": _NUM, "y": _NUM, "cut": {"type": "boolean"}},
          ["sketch", "width", "height"]),
    _tool("add_circle", "Add a circle centred at (x, y) to a sketch, or cut it out (cut: true).",
          {"sketch": _NAME, "radius": _POS, "x": _NUM, "y": _NUM, "cut": {"type": "boolean"}}, ["sketch", "radius"]),
    _tool("extrude", "Extrude a sketch into a named solid, height tall, its base at z.",
          {"sketch": _NAME, "height": _POS, "z": _NUM, "name": _NAME}, ["sketch", "height", "name"]),
    _tool("boolean", "A named solid from two solids: union, difference (a minus b) or intersection.",
          {"op": {"enum": ["union", "difference", "intersection"]}, "a": _NAME, "b": _NAME, "name": _NAME},
          ["op", "a", "b", "name"]),
    _tool("done", "The part is finished.", {}, []),
]  # fmt: skip
_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


class CallError(ValueError):
    """A call the environment refuses (the observation says why; nothing changes)."""


def parse_call(text: str) -> tuple[str, dict]:
    """``(tool, arguments)`` of one turn, validated against the tool's schema."""
    import jsonschema

    from tasks.verifiers import code_of

    body = code_of(text).strip()
    if body.lower() in ("", "done", "exit"):
        return "done", {}
    try:
        call = json.loads(body)
    except ValueError as exc:
        raise CallError(f"not a JSON tool call ({exc.msg} at {exc.pos})") from None
    if isinstance(call, dict) and isinstance(call.get("function"), dict):  # OpenAI's {"type": "function", "function": ...}
        call = call["function"]
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise CallError('expected {"name": TOOL, "arguments": {...}}')
    name, arguments = call["name"], call.get("arguments", {})
    if isinstance(arguments, str):  # arguments as a JSON string, as OpenAI's API sends them
        try:
            arguments = json.loads(arguments)
        except ValueError:
            raise CallError(f"{name}: arguments are not JSON") from None
    if name not in _SCHEMAS:
        raise CallError(f"unknown tool {name!r}; tools: {', '.join(_SCHEMAS)}")
    try:
        jsonschema.validate(arguments, _SCHEMAS[name])
    except jsonschema.ValidationError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "arguments"
        raise CallError(f"{name}: {where}: {exc.message}") from None
    return name, arguments


class Model:
    """The episode's sketches and solids."""

    def __init__(self) -> None:
        self.sketches: dict[str, Any] = {}
        self.solids: dict[str, Any] = {}
        self.part: Any = None

    def apply(self, name: str, a: dict) -> str:
        """Execute a validated call; what happened, for the model to read."""
        from manifold3d import CrossSection, Manifold

        if name == "new_sketch":
            self._room(a["name"], self.sketches)
            self.sketches[a["name"]] = CrossSection()
            return f"sketch {a['name']} started"
        if name in ("add_rect", "add_circle"):
            sketch = self._get(self.sketches, a["sketch"], "sketch")
            if name == "add_rect":
                shape = CrossSection.square([a["width"], a["height"]], center=True)
            else:
                shape = CrossSection.circle(a["radius"], SEGMENTS)
            shape = shape.translate([a.get("x", 0.0), a.get("y", 0.0)])
            self.sketches[a["sketch"]] = sketch - shape if a.get("cut") else sketch + shape
            return f"sketch {a['sketch']}: area {self.sketches[a['sketch']].area():.3f}"
        if name == "extrude":
            sketch = self._get(self.sketches, a["sketch"], "sketch")
            if sketch.area() <= 0:
                raise CallError(f"extrude: sketch {a['sketch']} is empty")
            self._room(a["name"], self.solids)
            solid = Manifold.extrude(sketch, a["height"]).translate([0.0, 0.0, a.get("z", 0.0)])
            return self._made(a["name"], solid)
        if name == "boolean":
            left, right = self._get(self.solids, a["a"], "solid"), self._get(self.solids, a["b"], "solid")
            self._room(a["name"], self.solids)
            solid = {"union": lambda: left + right, "difference": lambda: left - right,
                     "intersection": lambda: left ^ right}[a["op"]]()  # fmt: skip
            return self._made(a["name"], solid)
        raise CallError(f"unknown tool {name!r}")  # parse_call lets none through

    def _made(self, name: str, solid) -> str:
        if solid.is_empty():
            raise CallError(f"{name} would be empty")
        self.solids[name] = self.part = solid
        return f"solid {name}: {describe(properties(solid))}"

    @staticmethod
    def _get(table: dict, name: str, kind: str):
        if name not in table:
            raise CallError(f"no {kind} named {name!r}; there are: {', '.join(table) or 'none'}")
        return table[name]

    @staticmethod
    def _room(name: str, table: dict) -> None:
        if name not in table and len(table) >= MAX_OBJECTS:
            raise CallError(f"at most {MAX_OBJECTS} sketches and {MAX_OBJECTS} solids")


def properties(solid) -> dict[str, Any]:
    """What the reward checks: volume, bounding-box extents and through-holes (the genus of each
    piece, summed: Manifold's genus of a solid in several pieces counts each piece as -1)."""
    lo_x, lo_y, lo_z, hi_x, hi_y, hi_z = solid.bounding_box()
    holes = sum(piece.genus() for piece in solid.decompose())
    return {"volume": solid.volume(), "bbox": [hi_x - lo_x, hi_y - lo_y, hi_z - lo_z], "holes": holes}


def describe(p: dict[str, Any]) -> str:
    x, y, z = p["bbox"]
    return f"volume {p['volume']:.3f}, bounding box {x:.3f} x {y:.3f} x {z:.3f}, through-holes {p['holes']}"


def score(p: dict[str, Any] | None, target: dict[str, Any], tolerance: float) -> float:
    """The fraction of the target's checks the part meets (0 without a part)."""
    if p is None:
        return 0.0
    close = lambda got, want: abs(got - want) <= tolerance * max(abs(want), 1e-9)  # noqa: E731
    checks = [close(p["volume"], float(target["volume"])),
              all(close(g, float(w)) for g, w in zip(sorted(p["bbox"]), sorted(target["bbox"]))),
              p["holes"] == int(target["holes"])]  # fmt: skip
    return sum(checks) / len(checks)


class CadEnvironment:
    """The environment (registered as ``cad``): see the module's docstring."""

    def reset(self, task: Task) -> str | None:
        data = task.verifier.data
        target = data.get("target")
        if not isinstance(target, dict) or not {"volume", "bbox", "holes"} <= set(target):
            raise ValueError("cad: verifier.data.target needs volume, bbox (three extents) and holes")
        self.target, self.tolerance = target, float(data.get("tolerance", 0.02))
        self.model = Model()
        return None

    def step(self, action: str) -> Step:
        try:
            name, arguments = parse_call(action)
            if name == "done":
                return Step("done", reward=self.reward(), done=True)
            observation = self.model.apply(name, arguments)
        except CallError as exc:
            observation = f"refused: {exc}; nothing changed"
        return Step(observation, reward=self.reward())

    def reward(self) -> float:
        part = self.model.part
        return score(None if part is None else properties(part), self.target, self.tolerance)


def build(calls: list[dict]) -> dict[str, Any]:
    """The properties of the part a list of calls makes (a target from a reference build)."""
    model = Model()
    for call in calls:
        name, arguments = parse_call(json.dumps(call))
        model.apply(name, arguments)
    if model.part is None:
        raise ValueError("the calls make no solid")
    return properties(model.part)


def task(task_id: str, run_id: str, description: str, reference: list[dict], *, max_turns: int = 10, group_size: int = 4) -> Task:
    """A CAD task: the prompt describes the part, the target is what ``reference`` builds."""
    target = build(reference)
    prompt = (f"Build this part with the CAD tools, one JSON tool call per turn, then call done: {description}. "
              f"Target: {describe(target)}.")  # fmt: skip
    return Task(task_id=task_id, run_id=run_id, prompt=prompt, group_size=group_size, max_turns=max_turns, tools=TOOLS,
                verifier=VerifierSpec(kind="environment", data={"environment": "cad", "target": target}))  # fmt: skip


def plate_calls(w: float, h: float, t: float, holes: list[tuple[float, float, float]]) -> list[dict]:
    """The calls that make a w x h x t plate with round holes ``(x, y, radius)`` cut through it."""
    calls = [{"name": "new_sketch", "arguments": {"name": "s"}},
             {"name": "add_rect", "arguments": {"sketch": "s", "width": w, "height": h}}]  # fmt: skip
    calls += [{"name": "add_circle", "arguments": {"sketch": "s", "radius": r, "x": x, "y": y, "cut": True}} for x, y, r in holes]
    return calls + [{"name": "extrude", "arguments": {"sketch": "s", "height": t, "name": "part"}}]
