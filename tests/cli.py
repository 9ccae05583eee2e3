"""Running the ``conveyor`` command in-process (typer's CliRunner) without touching later tests.

The CLI's callback points structlog and logging at the runner's stderr, which is closed after the
invocation: a later test's log line would fail on it. Logging keeps its configuration here."""

from __future__ import annotations

import pytest


def invoke(monkeypatch: pytest.MonkeyPatch, args: list[str], env: dict | None = None):
    from typer.testing import CliRunner

    import conveyor.logging
    from launch.cli.main import app

    monkeypatch.setattr(conveyor.logging, "configure_logging", lambda *a, **kw: None)
    return CliRunner().invoke(app, [str(a) for a in args], env=env)
