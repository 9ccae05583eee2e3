"""``conveyor tasks validate`` and ``conveyor submit``: task files into a run.

``validate`` checks a JSONL or Parquet file against a preset or field mapping
without publishing anything: one line per bad record (``file:line: field:
reason``), a summary, exit 1 when any record is bad.

``submit`` loads a file and publishes every task to the run's tasks topic,
waiting for the broker to acknowledge each one. With ``--on-error fail`` (the
default) one bad record stops it before anything is published.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from launch.cli.exits import fail
from launch.cli.progress import progress

if TYPE_CHECKING:
    from conveyor.config import RunConfig
    from conveyor.contracts import Task
    from conveyor.transport.base import Transport
    from producers.loaders import FieldMapping, RecordError

app = typer.Typer(help="Task files: check them, publish them to a run.", no_args_is_help=True)

FILE = typer.Argument(..., help="Tasks: JSONL (optionally gzipped) or Parquet.")
PRESET = typer.Option(None, "--preset", help="plain | verl | trl (default: plain, or the mapping's own).")
MAPPING = typer.Option(None, "--mapping", help="YAML of field-mapping overrides (see producers/loaders/mapping.py).")
MAX_ERROR_LINES = 20  # submit prints this many rejections, then a count


def _mapping(preset: str | None, mapping: Path | None) -> FieldMapping:
    from conveyor.errors import ConfigError
    from producers.loaders import load_mapping, resolve_mapping

    try:
        return load_mapping(mapping, preset) if mapping is not None else resolve_mapping(preset=preset)
    except ConfigError as exc:
        fail(str(exc), exc.exit_code)


@app.command("validate")
def validate(
    file: Path = FILE,
    preset: str | None = PRESET,
    mapping: Path | None = MAPPING,
    run: str = typer.Option("validate", "--run", help="Run id the tasks would carry."),
) -> None:
    """Check a task file without publishing: every bad record is named, exit 1 if any."""
    from conveyor.errors import TerminalError
    from conveyor.images import image_reference
    from producers.loaders import TaskLoader

    fmap = _mapping(preset, mapping)
    try:
        loader = TaskLoader(file, run, fmap, on_error="skip", put_image=image_reference)  # images checked, not stored
        tasks = sum(1 for _ in loader)
    except (TerminalError, ValueError) as exc:
        fail(str(exc), 2)
    for err in loader.errors:
        typer.echo(str(err))
    bad = len(loader.errors)
    typer.echo(f"{file}: {loader.records} records, {tasks} tasks ok, {bad} rejected")
    if loader.records == 0:
        fail(f"{file}: no records", 1)
    if bad:
        raise typer.Exit(1)


# --------------------------------------------------------------------------
# submit


@dataclass
class SubmitReport:
    topic: str
    published: int = 0
    records: int = 0
    rejected: list[RecordError] = field(default_factory=list)


async def publish_tasks(transport: Transport, run_id: str, tasks: list[Task], partitions: int, on_task=None) -> tuple[str, int]:
    """Create the run's topics, publish ``tasks`` keyed by task id, wait for every ack; each task
    starts its trace here (``tracing:``), as from the producer. ``on_task(1)`` per task sent.

    Returns (tasks topic, tasks acknowledged); raises if the broker refused any.
    """
    from conveyor.messaging import Publisher
    from conveyor.topics import Topics
    from conveyor.tracing import headers_of, tracer

    topics = Topics(run_id)
    await transport.create_topics(topics.specs(partitions))
    producer = transport.producer()
    await producer.start()
    try:
        pub = Publisher(producer, topics.tasks)
        pending = []
        for task in tasks:
            with tracer().start_as_current_span(
                "submit", attributes={"conveyor.task_id": task.task_id, "conveyor.via": "cli"}
            ) as span:
                pending.append(await pub.publish(task, key=task.task_id, headers=headers_of(span)))
            if on_task is not None:
                on_task(1)
        results = await asyncio.gather(*pending, return_exceptions=True)
    finally:
        await producer.close()
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        raise RuntimeError(
            f"the broker acknowledged {len(results) - len(failed)} of {len(results)} tasks; first failure: {failed[0]!r}"
        )
    return topics.tasks, len(results)


def _transport_for(cfg: RunConfig) -> Transport:
    """The transport a config names; a memory transport would vanish with this process."""
    from conveyor.errors import ConfigError
    from conveyor.transport import open_transport

    if cfg.transport.type == "memory":
        raise ConfigError(
            "the memory transport lives inside one process: submit needs a broker "
            "(transport.type: kafka in --config, or CONVEYOR_TRANSPORT__TYPE=kafka)"
        )
    return open_transport(cfg.transport)


def submit_file(
    file: Path,
    run: str | None = None,
    config: Path | RunConfig | None = None,
    preset: str | None = None,
    mapping: Path | FieldMapping | None = None,
    on_error: str = "fail",
    group_size: int | None = None,
    *,
    transport: Transport | None = None,
) -> SubmitReport:
    """Load ``file`` and publish its tasks to ``run``'s tasks topic; the library form of ``submit``.

    ``config``: a run config (file or object; None: defaults and ``CONVEYOR_*``
    variables) naming the transport and partitions; ``run`` defaults to its
    run id. ``transport``: use this one instead of opening the config's (tests,
    embedded mode); it is left open. Raises ``RecordRejected`` (on_error fail),
    ``TaskFileError``, ``ConfigError`` or the transport's errors.
    """
    from conveyor.config import RunConfig, load_run_config, parse_run_config
    from conveyor.topics import validate_run_id
    from producers.loaders import FieldMapping, TaskLoader, load_mapping, resolve_mapping

    if isinstance(config, RunConfig):
        cfg = config
    else:
        cfg = load_run_config(config) if config is not None else parse_run_config({}, "<defaults>")
    from tasks import plugins

    plugins.register(cfg.reward)  # a task may name the run's own verifier kinds, environments and tools
    run_id = validate_run_id(run or cfg.run_id)
    if isinstance(mapping, FieldMapping):
        fmap = mapping
    else:
        fmap = load_mapping(mapping, preset) if mapping is not None else resolve_mapping(preset=preset)
    if fmap.default_group_size < 2:  # a record without a group size gets the run's, as over HTTP
        fmap = fmap.model_copy(update={"default_group_size": cfg.producer.group_size})
    # A task the broker would refuse is a rejected record, not a failed submit halfway through.
    limit = getattr(cfg.transport, "max_request_bytes", None)
    from conveyor.images import ImageKeeper
    from conveyor.objectstore import open_object_store

    loader = TaskLoader(
        file,
        run_id,
        fmap,
        on_error,  # type: ignore[arg-type]
        group_size=group_size,
        max_task_bytes=limit - (64 << 10) if limit else None,
        put_image=ImageKeeper(lambda: open_object_store(cfg.object_store)),  # the run's store keeps the file's images
    )
    tasks = list(loader)  # everything is checked before anything is published
    report = SubmitReport(topic="", records=loader.records, rejected=loader.errors)
    own = transport is None
    tp = _transport_for(cfg) if own else transport

    async def main() -> tuple[str, int]:
        try:
            with progress("submit", len(tasks), unit="tasks") as advance:
                return await publish_tasks(tp, run_id, tasks, cfg.transport.partitions, on_task=advance)
        finally:
            if own:
                await tp.close()

    from conveyor.tracing import configure_tracing, reset_tracing

    traced = configure_tracing(cfg.tracing, "submit", run_id) is not None
    try:
        report.topic, report.published = asyncio.run(main())
    finally:
        if traced:
            reset_tracing()  # exports the submit spans
    return report


@app.command("submit")
def submit(
    file: Path = FILE,
    run: str | None = typer.Option(None, "--run", help="Run id (default: the config's run_id)."),
    config: Path | None = typer.Option(
        None, "--config", "-c", exists=True, dir_okay=False, help="Run config naming the transport."
    ),
    preset: str | None = PRESET,
    mapping: Path | None = MAPPING,
    on_error: str = typer.Option(
        "fail", "--on-error", help="fail: stop at the first bad record, publish nothing; skip: publish the good ones."
    ),
    group_size: int | None = typer.Option(
        None,
        "--group-size",
        min=1,
        help="Samples per task, for every task (overrides the file's; default: the file's, else producer.group_size).",
    ),
) -> None:
    """Publish every task of a file to a run's tasks topic and wait for the broker's acks."""
    from conveyor.errors import ConfigError, ConveyorError
    from producers.loaders import RecordRejected, TaskFileError

    if on_error not in ("fail", "skip"):
        raise typer.BadParameter("fail or skip", param_hint="--on-error")
    try:
        report = submit_file(file, run, config, preset, mapping, on_error, group_size)
    except RecordRejected as exc:
        fail(f"{exc}\nnothing published (use --on-error skip to publish the good records)", 1)
    except (ConfigError, TaskFileError) as exc:
        fail(str(exc), exc.exit_code)
    except ValueError as exc:  # a bad run id
        fail(str(exc), 2)
    except ConveyorError as exc:
        fail(str(exc), exc.exit_code)
    except RuntimeError as exc:  # the broker refused some tasks
        fail(str(exc), 3)
    for err in report.rejected[:MAX_ERROR_LINES]:
        typer.echo(f"rejected {err}")
    if len(report.rejected) > MAX_ERROR_LINES:
        typer.echo(f"... and {len(report.rejected) - MAX_ERROR_LINES} more (conveyor tasks validate {file} lists them all)")
    typer.echo(
        f"published {report.published} tasks to {report.topic}; rejected {len(report.rejected)} of {report.records} records"
    )
    if report.published == 0:
        raise typer.Exit(1)
