"""Endless task streams from the built-in suites (train split only)."""

from __future__ import annotations

import functools
import importlib
import itertools
import random
from collections.abc import Callable, Iterator
from typing import Any

from conveyor.contracts import Task

SUITES = ("pyexpr", "python_functions", "terminal", "math_numeric", "tool_calls", "cad", "visual")


def _task_maker(mod: Any, put_image: Callable[[bytes], Any] | None) -> Callable[..., Task]:
    """The suite's ``to_task``; suites whose tasks carry pictures also get ``put_image``."""
    if getattr(mod, "NEEDS_IMAGES", False):
        return functools.partial(mod.to_task, put_image=put_image)
    return mod.to_task


def suite_stream(
    name: str,
    run_id: str,
    group_size: int,
    *,
    seed: int = 0,
    max_tasks: int | None = None,
    put_image: Callable[[bytes], Any] | None = None,
) -> Iterator[Task]:
    if name not in SUITES:
        raise ValueError(f"unknown suite {name!r}; built in: {', '.join(SUITES)}")
    mod = importlib.import_module(f"tasks.suites.{name}")
    to_task = _task_maker(mod, put_image)
    rng = random.Random(seed)
    if name == "pyexpr":
        stream = (mod.to_task(p, run_id, group_size, i) for i, p in enumerate(mod.sample_problems(rng)))
    else:
        train = [p for p in mod.problems() if p.split == "train"]

        def epochs() -> Iterator[Task]:
            index = 0
            while True:
                order = list(train)
                rng.shuffle(order)  # a new order every epoch, the same for the same seed
                for p in order:
                    yield to_task(p, run_id, group_size, index)
                    index += 1

        stream = epochs()
    return itertools.islice(stream, max_tasks) if max_tasks else stream


def suite_tasks(name: str, run_id: str, group_size: int, put_image: Callable[[bytes], Any] | None = None) -> list[Task]:
    """One task per train problem of a finite suite (what a curriculum schedules)."""
    if name == "pyexpr" or name not in SUITES:
        raise ValueError(f"suite {name!r} has no finite problem list: use one of {', '.join(SUITES[1:])}")
    mod = importlib.import_module(f"tasks.suites.{name}")
    to_task = _task_maker(mod, put_image)
    return [to_task(p, run_id, group_size, i) for i, p in enumerate(p for p in mod.problems() if p.split == "train")]
