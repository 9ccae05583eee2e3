"""The house's floors, read from the source: what each package may import.

- ``conveyor/`` is the ground floor (contracts, topics, config, transport, the
  object store and its keys): it imports nothing of the project's but itself.
- ``sandbox/`` (the bubblewrap harness and its limits) and ``tasks/`` (task
  families: problems, verifiers, tools) are libraries on it.
- The services (``producers/``, ``rollout_workers/``, ``reward/``, ``learner/``,
  ``storage/``) import the ground floor and the libraries, never each other.
- ``launch/`` (CLI, demo, supervisor, status, dev stack) sits on top: it may
  import anything, and nothing in the product imports it.
- The lake's reader (``storage/lake.py``, ``storage/replay.py``) is also a library any service
  may read the lake with (DESIGN.md): the one service module others may import.

Every import counts, also one inside a function: a lazy import is still a
dependency. No two modules may import each other, directly or round a circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVICES = {"producers", "rollout_workers", "reward", "learner", "storage"}
ALLOWED = {
    "conveyor": {"conveyor"},
    "sandbox": {"conveyor", "sandbox"},
    "tasks": {"conveyor", "sandbox", "tasks"},
    **{s: {"conveyor", "sandbox", "tasks", s} for s in SERVICES},
    "launch": {"conveyor", "sandbox", "tasks", "launch", *SERVICES},
}
LAKE_READER = {"storage.lake", "storage.replay"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """The project modules ``path`` imports, as dotted names."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)  # `from pkg import module`
    return {name for name in found if name.split(".")[0] in ALLOWED}


def project_files() -> list[Path]:
    return sorted(p for top in ALLOWED for p in (ROOT / top).rglob("*.py"))


def graph() -> dict[str, set[str]]:
    files = project_files()
    modules = {module_name(p) for p in files}
    return {module_name(p): {m for m in imports_of(p) if m in modules and m != module_name(p)} for p in files}


def layer_violations(edges: dict[str, set[str]]) -> list[str]:
    def allowed(src: str, dst: str) -> bool:
        top = src.split(".")[0]
        return dst.split(".")[0] in ALLOWED[top] or (top in SERVICES and dst in LAKE_READER)

    return sorted(f"{src} imports {dst}" for src, dsts in edges.items() for dst in dsts if not allowed(src, dst))


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, ()):
            # a package's __init__ importing its own submodules is how packages export, not a circle
            if v == w.rpartition(".")[0]:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_each_floor_imports_only_what_is_below_it():
    assert layer_violations(graph()) == []


def test_no_import_circles():
    assert circles(graph()) == []


def test_the_rules_catch_each_kind_of_violation():
    """The checks themselves: one edge of each forbidden kind is reported."""
    edges = graph()
    for src, dst in [
        ("conveyor.messaging", "storage.sink"),  # the ground floor imports a service
        ("sandbox.runner", "launch.stack.components"),  # a library imports the launch layer
        ("rollout_workers.worker", "reward.bridge"),  # one service imports another
        ("learner.recipe", "launch.demo"),  # a service imports the launch layer
        ("tasks.verifiers", "reward.scorers"),  # a library imports a service
        ("learner.recipe", "storage.sink"),  # a service imports another service's non-library module
    ]:
        mutated = {**edges, src: edges[src] | {dst}}
        assert layer_violations(mutated) == [f"{src} imports {dst}"]
    assert layer_violations({**edges, "learner.offline": edges["learner.offline"] | {"storage.lake"}}) == []  # the lake reader
    mutated = {**edges, "conveyor.topics": edges["conveyor.topics"] | {"conveyor.admission"}}
    assert any({"conveyor.admission", "conveyor.topics"} <= set(c) for c in circles(mutated))


def test_imports_are_read_from_the_source():
    """Relative, lazy and `from package import module` imports all count."""
    assert "conveyor.objectstore" in imports_of(ROOT / "conveyor" / "messaging.py")
    assert {"sandbox.cgroups", "conveyor.binaries"} <= imports_of(ROOT / "sandbox" / "runner.py")
