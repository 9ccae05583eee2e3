"""Progress of long CLI work on stderr: rich's bar with counts, rate and time left where the total
is known; nothing at all when stderr is not a terminal (logs and pipes stay clean)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text

Advance = Callable[..., None]


class Rate(ProgressColumn):
    """Units per second, once rich has enough samples to say."""

    def __init__(self, unit: str) -> None:
        super().__init__()
        self.unit = unit

    def render(self, task) -> Text:
        return Text(f"{task.speed:.1f} {self.unit}/s" if task.speed else "", style="progress.data.speed")


@contextmanager
def progress(description: str, total: float | None, *, unit: str = "", console: Console | None = None) -> Iterator[Advance]:
    """``advance(n=1, **fields)``: ``n`` more done; ``fields`` replace the line's ``status`` text
    (e.g. ``status="step 12, reward 0.61"``). ``total`` None: a count without an end."""
    console = console or Console(stderr=True)
    if not console.is_terminal:
        yield lambda *_, **__: None
        return
    columns = [SpinnerColumn(), TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), Rate(unit),
               TimeElapsedColumn(), TimeRemainingColumn(), TextColumn("{task.fields[status]}")]  # fmt: skip
    with Progress(*columns, console=console, transient=False) as bar:
        task = bar.add_task(description, total=total, status="")

        def advance(n: float = 1, **fields) -> None:
            bar.update(task, advance=n, **fields)

        yield advance
