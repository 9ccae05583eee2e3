"""``conveyor sandbox exec``: run a file in the reward service's sandbox."""

from __future__ import annotations

import json
from pathlib import Path

import typer

app = typer.Typer(help="The reward sandbox, from outside (operators, testing).", no_args_is_help=True)


@app.command("exec")
def exec_(
    file: Path = typer.Argument(..., exists=True, dir_okay=False, help="A Python file to run."),
    timeout: float = typer.Option(2.0, "--timeout", min=0.01, help="Wall-clock limit, seconds."),
    memory_mb: int = typer.Option(256, "--memory-mb", min=16, help="Address-space limit, MB."),
    workspace: Path | None = typer.Option(
        None, "--workspace", exists=True, file_okay=False, help="A directory to run in (mounted as an overlay: never written)."
    ),
    cgroups: str = typer.Option("auto", "--cgroups", help="auto | required | off"),
) -> None:
    """Run FILE in the sandbox with the service's default limits; the last line of stdout is the
    result as one JSON object (verdict, exit_code, stdout, stderr, duration_s, peak_memory_mb, feedback).
    The caller's environment is not passed in. Exit status: 0 when the program passed, 1 otherwise,
    3 when the sandbox cannot run on this host."""
    from sandbox.runner import Job, Sandbox, SandboxLimits, SandboxUnavailable
    from sandbox.workspace import Workspace

    if cgroups not in ("auto", "required", "off"):
        raise typer.BadParameter("must be auto, required or off", param_hint="--cgroups")
    try:
        sandbox = Sandbox(SandboxLimits(timeout_s=timeout, memory_mb=memory_mb), parallel=1, cgroups_mode=cgroups)  # type: ignore[arg-type]
    except SandboxUnavailable as exc:
        typer.secho(f"sandbox unavailable: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(3) from None
    try:
        ws = Workspace(workspace) if workspace else None
        try:
            [result] = sandbox.run([Job(file.read_text())], ws)
        finally:
            if ws is not None:
                ws.close()
    finally:
        sandbox.close()
    typer.echo(json.dumps(result.to_dict()))
    raise typer.Exit(0 if result.verdict == "pass" else 1)
