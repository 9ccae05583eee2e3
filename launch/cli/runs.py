"""``conveyor runs list|show|export-model`` and ``conveyor replay``: runs after the fact."""

from __future__ import annotations

import asyncio
import json
import time
from datetime import datetime
from pathlib import Path

import typer

from launch.cli.progress import progress

app = typer.Typer(help="Runs kept in the object store: list them, show one.", no_args_is_help=True)
CONFIG = typer.Option(None, "--config", "-c", exists=True, dir_okay=False, help="Run config naming the object store.")
STORE = typer.Option(
    Path("runs/objects"), "--store", help="A local object-store directory (when no --config); the demo's default."
)


def open_store(config: Path | None, store: Path):
    from conveyor.objectstore import LocalObjectStore, open_object_store

    if config is not None:
        from conveyor.config import load_run_config
        from conveyor.errors import ConfigError

        try:
            return open_object_store(load_run_config(config).object_store)
        except ConfigError as exc:
            typer.secho(str(exc), fg=typer.colors.RED, err=True)
            raise typer.Exit(2) from None
    if not store.is_dir():
        typer.secho(
            f"no object store at {store} (run `conveyor demo` first, or pass --config/--store)", fg=typer.colors.RED, err=True
        )
        raise typer.Exit(2)
    return LocalObjectStore(store)


@app.command("list")
def list_(config: Path | None = CONFIG, store: Path = STORE, as_json: bool = typer.Option(False, "--json")) -> None:
    """Every run with objects in the store."""
    from storage.runs import list_runs

    runs = list_runs(open_store(config, store))
    if as_json:
        typer.echo(json.dumps(runs, indent=2))
        return
    for r in runs:
        created = r.get("created_at")
        when = "" if created is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(created))
        typer.echo(f"{r['run_id']:<40} {when:<20} {r['objects']:>6} objects {r['bytes'] / 2**20:>9.1f} MiB")


@app.command("show")
def show(run: str = typer.Argument(...), config: Path | None = CONFIG, store: Path = STORE) -> None:
    """A run's metadata, end figures, lake statistics and weight versions (JSON)."""
    from storage.runs import show_run

    typer.echo(json.dumps(show_run(open_store(config, store), run), indent=2, default=str))


@app.command("export-model")
def export_model(
    run: str = typer.Argument(..., help="Run id."),
    out: Path = typer.Argument(..., help="Directory to write the model to (Hugging Face format)."),
    version: int | None = typer.Option(None, "--version", min=1, help="Policy version [default: the newest]."),
    base_model: str | None = typer.Option(
        None,
        "--base-model",
        help="The model the run started from: for a run that stored no config or tokenizer, and for a LoRA run "
        "(its adapter is merged into it).",
    ),
    dtype: str = typer.Option("auto", help="auto (the config's torch_dtype) | float32 | bfloat16 | float16"),
    config: Path | None = CONFIG,
    store: Path = STORE,
) -> None:
    """A published policy version as a model directory that transformers and vLLM load."""
    from launch.cli import models
    from storage.model_export import STAGES, ExportError
    from storage.model_export import export_model as export

    base = models.resolved(base_model) if base_model else None
    try:
        with progress("export-model", STAGES, unit="stages") as advance:
            written = export(open_store(config, store), run, out, version=version, base=base, dtype=dtype, on_stage=advance)
    except ExportError as exc:
        typer.secho(str(exc), fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None
    typer.echo(json.dumps(written, indent=2))


def replay(
    run: str = typer.Argument(..., help="Run id."),
    to_topic: str | None = typer.Option(None, "--to-topic", help="Re-publish to this topic (transport from --config)."),
    rate: float | None = typer.Option(None, "--rate", min=0.001, help="At most this many rollouts per second."),
    export: str | None = typer.Option(None, "--export", help="jsonl | parquet"),
    out: Path | None = typer.Option(None, "--out", help="File to export to."),
    version_min: int | None = typer.Option(None, "--version-min"),
    version_max: int | None = typer.Option(None, "--version-max"),
    reward_min: float | None = typer.Option(None, "--reward-min"),
    reward_max: float | None = typer.Option(None, "--reward-max"),
    verdict: list[str] | None = typer.Option(None, "--verdict", help="Repeatable: pass, fail, error, ..."),
    since: float | None = typer.Option(None, "--since", help="Scored at or after (unix seconds)."),
    until: float | None = typer.Option(None, "--until", help="Scored at or before (unix seconds)."),
    table_version: int | None = typer.Option(None, "--table-version", min=0, help="Read the rollouts table as of this version."),
    as_of: datetime | None = typer.Option(None, "--as-of", help="Read the rollouts table as it was at this time (UTC)."),
    config: Path | None = CONFIG,
    store: Path = STORE,
) -> None:
    """Replay a run's trajectories from the lake, in a deterministic order, to a topic or a file."""
    from storage.lake import LakeFilter, LakeReader

    if (to_topic is None) == (export is None):
        raise typer.BadParameter("give exactly one of --to-topic or --export")
    flt = LakeFilter(version_min, version_max, reward_min, reward_max, frozenset(verdict) if verdict else None, since, until)
    reader = LakeReader(open_store(config, store), run, version=table_version, as_of=as_of)
    with reader.leased():
        _replay(reader, flt, run, to_topic, rate, export, out, config)


def _replay(reader, flt, run, to_topic, rate, export, out, config) -> None:
    from storage.replay import export as export_rows
    from storage.replay import replay_to_topic

    if export is not None:
        if export not in ("jsonl", "parquet"):
            raise typer.BadParameter("jsonl or parquet", param_hint="--export")
        target = out or Path(f"{run}.{export}")
        with progress("export", None, unit="rollouts") as advance:
            n = export_rows(reader, flt, export, target, on_rows=advance)
        typer.echo(f"exported {n} rollouts to {target}")
        return
    if config is None:
        raise typer.BadParameter("--to-topic needs --config (it names the transport)")
    from conveyor.config import load_run_config
    from conveyor.transport import open_transport

    transport = open_transport(load_run_config(config).transport)

    async def main() -> int:
        try:
            with progress("replay", None, unit="rollouts") as advance:
                return await replay_to_topic(reader, flt, transport, to_topic, rate_per_s=rate, on_rows=advance)
        finally:
            await transport.close()

    typer.echo(f"published {asyncio.run(main())} rollouts to {to_topic}")


@app.command("compact")
def compact(
    run: str = typer.Argument(..., help="Run id."),
    target_mb: int = typer.Option(128, "--target-mb", min=1, help="Size of the files written."),
    config: Path | None = CONFIG,
    store: Path = STORE,
) -> None:
    """Rewrite a run's rollouts table into fewer, larger files sorted by policy version (one commit;
    readers of older versions are not disturbed)."""
    from storage.table import RolloutTable

    table = RolloutTable(open_store(config, store), run)
    if not table.exists():
        typer.echo(f"run {run!r} has no rollouts table (conveyor runs migrate copies an older lake into one)", err=True)
        raise typer.Exit(2)
    metrics = table.compact(target_mb=target_mb)
    typer.echo(json.dumps({k: metrics.get(k) for k in ("numFilesAdded", "numFilesRemoved", "totalConsideredFiles")}))


@app.command("vacuum")
def vacuum(
    run: str = typer.Argument(..., help="Run id."),
    retention_hours: int = typer.Option(168, "--retention-hours", min=0, help="Keep every file a version this recent needs."),
    dry_run: bool = typer.Option(False, "--dry-run", help="List what would be deleted."),
    config: Path | None = CONFIG,
    store: Path = STORE,
) -> None:
    """Delete data files no recent table version needs: files compaction replaced, and files a killed
    sink wrote but never committed. Versions leased by a replay, export or offline recipe in progress are kept."""
    from storage.table import RolloutTable

    table = RolloutTable(open_store(config, store), run)
    if not table.exists():
        typer.echo(f"run {run!r} has no rollouts table", err=True)
        raise typer.Exit(2)
    removed = table.vacuum(retention_hours=retention_hours, dry_run=dry_run)
    typer.echo(f"{'would delete' if dry_run else 'deleted'} {len(removed)} files")


@app.command("migrate")
def migrate(
    run: str = typer.Argument(..., help="Run id."),
    delete_parts: bool = typer.Option(False, "--delete-parts", help="Remove the older parts once copied."),
    config: Path | None = CONFIG,
    store: Path = STORE,
) -> None:
    """Copy a run stored in the older part-and-manifest layout into its rollouts table (each rollout once)."""
    from storage import lake_parts

    st = open_store(config, store)
    if not lake_parts.has_parts(st, run):
        typer.echo(f"run {run!r} has no parts in the older layout", err=True)
        raise typer.Exit(2)
    try:
        rows = lake_parts.migrate_parts(st, run)
    except ValueError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2) from None
    removed = lake_parts.delete_parts(st, run) if delete_parts else 0
    typer.echo(f"copied {rows} rollouts into the table" + (f"; deleted {removed} objects" if removed else ""))
