"""``conveyor stack up|status|down``: the local stack from pip-installed binaries."""

from __future__ import annotations

import json
from pathlib import Path

import typer

app = typer.Typer(help="Start, check and stop the local stack (Kafka-protocol broker, S3, Redis).", no_args_is_help=True)

STATE_DIR = typer.Option(
    None, "--state-dir", help="Where state, data and logs live [env CONVEYOR_STACK_DIR; default .conveyor/stack]."
)


def _stack(state_dir: Path | None, base_port: int | None = None):
    from launch.stack.manager import Stack, StackPorts

    ports = StackPorts.from_base(base_port) if base_port else StackPorts()
    return Stack(state_dir, ports)


def _fail(exc: Exception) -> None:
    typer.secho(str(exc), fg=typer.colors.RED, err=True)
    raise typer.Exit(getattr(exc, "exit_code", 1))


@app.command()
def up(
    state_dir: Path | None = STATE_DIR,
    only: str = typer.Option("kafka,s3,redis", help="Comma-separated components to start."),
    base_port: int | None = typer.Option(
        None, help="Use ten consecutive ports from here instead of the defaults (kafka 19092, s3 18333, redis 16379)."
    ),
    timeout: float = typer.Option(60.0, help="Seconds to wait for every health check."),
) -> None:
    """Start the components and wait until each answers a real request."""
    from launch.stack.components import LOCAL_S3_ACCESS_KEY, LOCAL_S3_SECRET_KEY, BinaryMissing
    from launch.stack.manager import StackError, ephemeral_port_range, in_ephemeral_range

    stack = _stack(state_dir, base_port)
    low, high = ephemeral_port_range()
    if base_port and in_ephemeral_range(base_port, 10, (low, high)):
        typer.secho(
            f"warning: ports {base_port}-{base_port + 9} are in this machine's ephemeral range {low}-{high}: "
            "while a component is down, an outgoing connection can take its port and its restart fails; "
            f"a base port below {low - 10} avoids that",
            fg=typer.colors.YELLOW,
            err=True,
        )
    try:
        running = stack.up([c.strip() for c in only.split(",") if c.strip()], timeout_s=timeout)
    except (StackError, BinaryMissing) as exc:
        _fail(exc)
    typer.echo(f"stack up in {stack.state_dir}")
    for name, comp in running.items():
        typer.echo(f"  {name:<6} {comp.endpoint:<28} pid {comp.pid}  log {comp.log}")
    typer.echo("\nPoint a run config at it with:")
    if "kafka" in running:
        typer.echo(f"  export CONVEYOR_TRANSPORT__TYPE=kafka CONVEYOR_TRANSPORT__BOOTSTRAP_SERVERS={running['kafka'].endpoint}")
    if "s3" in running:
        typer.echo(
            f"  export CONVEYOR_OBJECT_STORE__TYPE=s3 CONVEYOR_OBJECT_STORE__ENDPOINT_URL={running['s3'].endpoint} "
            f"CONVEYOR_OBJECT_STORE__ACCESS_KEY_ID={LOCAL_S3_ACCESS_KEY} "
            f"CONVEYOR_OBJECT_STORE__SECRET_ACCESS_KEY={LOCAL_S3_SECRET_KEY}"
        )
    if "redis" in running:
        typer.echo(f"  export CONVEYOR_CELERY__TYPE=redis CONVEYOR_CELERY__URL={running['redis'].endpoint}")


@app.command()
def status(
    state_dir: Path | None = STATE_DIR,
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Show each component's pid, endpoint and health. Exit 0 only if all are healthy."""
    stack = _stack(state_dir)
    report = stack.status()
    if as_json:
        typer.echo(json.dumps(report, indent=2))
    elif not report:
        typer.echo(f"no stack recorded in {stack.state_dir}")
    else:
        for name, st in report.items():
            state = "healthy" if st["healthy"] else ("UNHEALTHY" if st["alive"] else "DEAD")
            line = f"  {name:<6} {st['endpoint']:<28} pid {st['pid']:<8} {state}"
            if st["error"]:
                line += f"  ({st['error']})"
            typer.echo(line)
    if not report:
        raise typer.Exit(14)
    if not all(st["healthy"] for st in report.values()):
        raise typer.Exit(13)


@app.command()
def down(
    state_dir: Path | None = STATE_DIR,
    grace: float = typer.Option(10.0, help="Seconds between SIGTERM and SIGKILL."),
) -> None:
    """Stop every component: SIGTERM, wait, then SIGKILL."""
    from launch.stack.manager import StackError

    stack = _stack(state_dir)
    try:
        stopped = stack.down(grace_s=grace)
    except StackError as exc:
        _fail(exc)
    typer.echo(f"stopped {', '.join(stopped)}")
