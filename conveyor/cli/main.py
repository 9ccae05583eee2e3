"""The ``conveyor`` command. Heavy modules are imported inside commands, so
``conveyor --help`` answers at once."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from conveyor.cli import stack as stack_cli
from conveyor.cli import topics as topics_cli

app = typer.Typer(
    name="conveyor",
    help="Asynchronous rollout/learner pipeline for RL post-training of language models.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
config_app = typer.Typer(help="Run configs.", no_args_is_help=True)
app.add_typer(config_app, name="config")
app.add_typer(stack_cli.app, name="stack")
app.add_typer(topics_cli.app, name="topics")


@app.callback()
def _root(
    log_level: str = typer.Option("warning", "--log-level", help="debug | info | warning | error"),
) -> None:
    from conveyor.logging import configure_logging

    configure_logging("cli", fmt="console", level=log_level)


def fail(message: str, code: int) -> None:
    typer.secho(message, fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


@app.command()
def version() -> None:
    """Print the installed version."""
    from importlib.metadata import version as dist_version

    typer.echo(dist_version("conveyor"))


@config_app.command("validate")
def config_validate(
    file: Path = typer.Argument(..., help="Run config (YAML)."),
    show: bool = typer.Option(False, "--show", help="Print the config with defaults filled in."),
    connect: bool = typer.Option(False, "--connect", help="Also connect to the broker, object store and Celery broker it names."),
) -> None:
    """Check a run config: unknown keys, bad values and bad backends are named."""
    from conveyor.config import load_run_config
    from conveyor.errors import ConfigError

    try:
        cfg = load_run_config(file)
    except ConfigError as exc:
        fail(str(exc), exc.exit_code)
    typer.echo(f"{file}: ok (run {cfg.run_id}, transport {cfg.transport.type}, object store {cfg.object_store.type}, "
               f"celery {cfg.celery.type})")
    if show:
        import yaml

        typer.echo(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    if connect:
        from conveyor.probe import probe_all

        results = probe_all(cfg)
        for r in results:
            mark = "ok  " if r.ok else "FAIL"
            typer.echo(f"  {mark} {r.section:<13} {r.target}: {r.detail}")
        if not all(r.ok for r in results):
            raise typer.Exit(3)


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
