"""``conveyor topics list|tail``: look at a running broker."""

from __future__ import annotations

import json
from pathlib import Path

import typer

app = typer.Typer(help="Inspect topics on a running broker.", no_args_is_help=True)

BOOTSTRAP = typer.Option(None, "--bootstrap", help="host:port of the broker.")
CONFIG = typer.Option(None, "--config", help="Take the broker from this run config.")


def resolve_bootstrap(bootstrap: str | None, config: Path | None, state_dir: Path | None = None) -> str:
    """--bootstrap, else the config's Kafka transport, else the local stack's broker."""
    if bootstrap:
        return bootstrap
    if config is not None:
        from conveyor.config import load_run_config

        cfg = load_run_config(config)
        if cfg.transport.type != "kafka":
            raise typer.BadParameter(f"{config} uses the {cfg.transport.type} transport; topics need a broker")
        return cfg.transport.bootstrap_servers
    from launch.stack.manager import Stack

    endpoint = Stack(state_dir).endpoints().get("kafka")
    if endpoint:
        return endpoint
    return "127.0.0.1:19092"


def _transport(bootstrap: str):
    from conveyor.config import KafkaTransportConfig
    from conveyor.transport.kafka import KafkaTransport

    return KafkaTransport(KafkaTransportConfig(bootstrap_servers=bootstrap, connect_deadline_s=5.0))


@app.command("list")
def list_topics(bootstrap: str | None = BOOTSTRAP, config: Path | None = CONFIG) -> None:
    """List the topics on the broker."""
    import asyncio

    from conveyor.errors import ConveyorError

    server = resolve_bootstrap(bootstrap, config)
    try:
        names = asyncio.run(_transport(server).list_topics())
    except ConveyorError as exc:
        typer.secho(str(exc), fg=typer.colors.RED, err=True)
        raise typer.Exit(exc.exit_code) from None
    for name in names:
        typer.echo(name)


@app.command()
def tail(
    topic: str = typer.Argument(..., help="Full topic name, e.g. conveyor.demo.rollouts"),
    bootstrap: str | None = BOOTSTRAP,
    config: Path | None = CONFIG,
    from_beginning: bool = typer.Option(True, "--from-beginning/--new", help="Start at the oldest record or only show new ones."),
    limit: int | None = typer.Option(None, "--limit", "-n", help="Stop after this many records."),
    idle_timeout: float | None = typer.Option(None, "--idle-timeout", help="Stop after this many seconds without a record."),
) -> None:
    """Print records as JSON lines, decoded by the topic's message type.

    Reads in a throw-away consumer group and never commits, so it does not
    disturb the services' positions.
    """
    import asyncio
    import time
    import uuid

    from conveyor.contracts import DecodeError, decode, decode_any, to_builtins
    from conveyor.errors import ConveyorError
    from conveyor.topics import message_type_of

    server = resolve_bootstrap(bootstrap, config)
    msg_type = message_type_of(topic)

    async def run() -> None:
        consumer = _transport(server).consumer([topic], f"conveyor-tail-{uuid.uuid4().hex[:8]}", from_beginning=from_beginning)
        await consumer.start()
        shown = 0
        last = time.monotonic()
        try:
            while limit is None or shown < limit:
                records = await consumer.getmany(timeout_s=0.5)
                if not records:
                    if idle_timeout is not None and time.monotonic() - last > idle_timeout:
                        return
                    continue
                last = time.monotonic()
                for r in records:
                    head = {
                        "partition": r.partition,
                        "offset": r.offset,
                        "key": r.key.decode(errors="replace") if r.key else None,
                    }
                    try:
                        msg = decode(r.value, msg_type) if msg_type else decode_any(r.value)
                        head["value"] = to_builtins(msg)
                    except DecodeError as exc:
                        head["error"] = str(exc)
                        head["raw_bytes"] = len(r.value)
                    typer.echo(json.dumps(head, default=str))
                    shown += 1
                    if limit is not None and shown >= limit:
                        return
        finally:
            await consumer.close()

    try:
        asyncio.run(run())
    except ConveyorError as exc:
        typer.secho(str(exc), fg=typer.colors.RED, err=True)
        raise typer.Exit(exc.exit_code) from None
    except KeyboardInterrupt:
        pass
