"""``conveyor run CONFIG --stack local`` and ``conveyor status``."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import typer

from launch.cli import models
from launch.cli.progress import progress


def run(
    config: Path = typer.Argument(..., exists=True, dir_okay=False, help="Run config (YAML)."),
    stack: str = typer.Option("local", "--stack", help="local: start (or reuse) the local stack and point the run at it."),
    state_dir: Path | None = typer.Option(None, "--state-dir", help="The local stack's directory [default .conveyor/stack]."),
    model: str | None = typer.Option(
        None, "--model", help=f"Initial policy; default: the demo's tiny model, warmed up. {models.HELP}"
    ),
    rollout_workers: int = typer.Option(1, min=1),
    reward_workers: int = typer.Option(1, min=1),
    budget: float = typer.Option(120.0, help="Seconds to run before draining (0: until Ctrl-C)."),
    warmup_steps: int = typer.Option(800, help="Warm-up steps of the default model."),
    out: Path = typer.Option(Path("runs"), help="Runs directory."),
    metrics_from: int | None = typer.Option(
        None,
        "--metrics-from",
        min=1024,
        max=65000,
        help="Each role serves Prometheus metrics on its own port from this one; with --prometheus, scraped.",
    ),
    prometheus: int | None = typer.Option(
        None,
        "--prometheus",
        min=1024,
        max=65535,
        help="Start a Prometheus server on this port scraping every role (Debian's prometheus package).",
    ),
) -> None:
    """Run every role as its own process (conveyor serve <role>), meeting only through topics, Celery and S3."""
    from conveyor.config import load_run_config
    from conveyor.errors import ConfigError
    from conveyor.logging import configure_logging
    from launch.demo import warmed_tiny_policy
    from launch.stack.manager import Stack, StackError, pid_alive
    from launch.supervisor import Supervisor, resolve_for_stack, write_run_config

    configure_logging("run", fmt="console", level="info")
    if prometheus is not None and metrics_from is None:
        raise typer.BadParameter("--prometheus scrapes the roles' metrics: give --metrics-from too", param_hint="--prometheus")
    if stack != "local":
        raise typer.BadParameter("only --stack local is built in; for Kubernetes see deploy/", param_hint="--stack")
    try:
        cfg = load_run_config(config)
    except ConfigError as exc:
        typer.secho(str(exc), fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None
    given_model = models.resolved(model) if model else None  # before anything starts: a bad id exits 2
    st = Stack(state_dir)
    running = {n: c for n, c in st.read_state().items() if pid_alive(c.pid)}
    if not {"kafka", "s3", "redis"} <= running.keys():
        try:
            st.up(["kafka", "s3", "redis"], timeout_s=90)
        except StackError as exc:
            typer.secho(str(exc), fg=typer.colors.RED, err=True)
            raise typer.Exit(getattr(exc, "exit_code", 1)) from None
    run_dir = (out / cfg.run_id).resolve()
    path = write_run_config(run_dir, resolve_for_stack(cfg, st.endpoints()))
    model_dir = given_model or warmed_tiny_policy(run_dir / "model", warmup_steps)
    sup = Supervisor(run_dir, path, model_dir, rollout_workers=rollout_workers, reward_workers=reward_workers,
                     evaluator=cfg.eval.every > 0, metrics_port_base=metrics_from)  # fmt: skip
    typer.echo(f"run {cfg.run_id}: config {path}, logs {run_dir / 'logs'}")
    if sup.metrics_ports:
        typer.echo("metrics: " + ", ".join(f"{name} :{port}" for name, port in sup.metrics_ports.items()))
    server = None
    if prometheus is not None:
        from conveyor.binaries import BinaryMissing
        from launch.stack.prometheus import Prometheus

        try:
            server = Prometheus(run_dir / "prometheus", prometheus, sup.metrics_ports, interval_s=5.0).start()
        except (BinaryMissing, RuntimeError) as exc:
            typer.secho(f"prometheus did not start: {exc}", fg=typer.colors.RED, err=True)
            raise typer.Exit(1) from None
        typer.echo(f"prometheus: {server.url} (load deploy/grafana/conveyor-dashboard.json in Grafana)")
    sup.start()
    started = time.monotonic()
    try:
        with progress(f"run {cfg.run_id}", budget if budget > 0 else None, unit="s") as advance:
            last = started
            while budget <= 0 or time.monotonic() - started < budget:
                sup.tick()
                time.sleep(0.5)
                now = time.monotonic()
                advance(now - last, status=_learner_status(run_dir / "metrics.jsonl", sup))
                last = now
    except KeyboardInterrupt:
        typer.echo("stopping (draining front to back)...")
    codes = sup.stop()
    if server is not None:
        server.stop()
    restarts = {n: r.restarts for n, r in sup.roles.items() if r.restarts}
    typer.echo(json.dumps({"exit_codes": codes, "restarts": restarts}))
    failed = {name: code for name, code in codes.items() if code != 0}
    if failed:  # a role that did not drain (killed after its grace, or exited with an error while stopping)
        typer.secho(f"the stop did not drain cleanly: {failed} (see {run_dir / 'logs'})", fg=typer.colors.RED, err=True)
        raise typer.Exit(1)


def status(
    run_id: str = typer.Argument(..., help="Run id (its config is runs/<run>/run.yaml unless --config)."),
    config: Path | None = typer.Option(None, "--config", "-c", exists=True, dir_okay=False),
    out: Path = typer.Option(Path("runs"), help="Runs directory."),
) -> None:
    """Per-topic consumer lag, workers alive, policy version, throughput and the lake of a run."""
    from conveyor.config import load_run_config
    from launch.status import collect

    path = config or out / run_id / "run.yaml"
    if not path.exists():
        raise typer.BadParameter(f"no config at {path}; pass --config", param_hint="--config")
    typer.echo(json.dumps(asyncio.run(collect(load_run_config(path))), indent=2, default=str))


def _learner_status(metrics: Path, sup) -> str:
    """The learner's newest step (the last line of its metrics.jsonl) and the roles that are up."""
    up = sum(1 for pid in sup.alive().values() if pid)
    try:
        with metrics.open("rb") as fh:
            fh.seek(max(0, metrics.stat().st_size - 8192))
            row = json.loads(fh.read().decode(errors="replace").strip().splitlines()[-1])
    except (OSError, ValueError, IndexError):
        return f"{up}/{len(sup.roles)} roles up, waiting for the learner's first step"
    reward = row.get("reward_mean")
    return f"{up}/{len(sup.roles)} roles up, step {row.get('step')}, version {row.get('version')}" + (
        f", reward {reward:.3f}" if isinstance(reward, (int, float)) else ""
    )
