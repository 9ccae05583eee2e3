"""How a command refuses: the reason in red on stderr, and an exit code (2: bad input or config)."""

from __future__ import annotations

from typing import NoReturn

import typer


def fail(message: str, code: int = 2) -> NoReturn:
    typer.secho(message, fg=typer.colors.RED, err=True)
    raise typer.Exit(code)
