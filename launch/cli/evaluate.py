"""``conveyor eval``: a model's held-out pass rate on a task file, through the run's engines and
verifiers (``rollout_workers/evaluation.py``).

The model is a local directory or Hub id (``--model``), or a run's published version
(``--run RUN [--version V]``, exported from the object store first). Prints pass@1, pass@k, the
mean reward and the mean length, and writes the whole report (every task's samples) as JSON.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
from pathlib import Path

import typer

from launch.cli import models
from launch.cli.exits import fail
from launch.cli.progress import progress
from launch.cli.runs import CONFIG, STORE, open_store


def evaluate(
    data: Path = typer.Option(..., "--data", exists=True, dir_okay=False, help="Tasks: JSONL (optionally gzipped) or Parquet."),
    model: str | None = typer.Option(None, "--model", help=models.HELP),
    run: str | None = typer.Option(None, "--run", help="Evaluate this run's published policy instead of --model."),
    version: int | None = typer.Option(None, "--version", min=1, help="The run's version (default: the newest)."),
    preset: str | None = typer.Option(None, "--preset", help="plain | verl | trl (the data file's layout)."),
    split: str | None = typer.Option(
        "heldout", "--split", help="Which records to evaluate: heldout | train | all (default: heldout, else all)."
    ),
    k: int = typer.Option(1, "--k", min=1, help="pass@k's k."),
    samples: int | None = typer.Option(None, "--samples", min=1, help="Samples per task (default: k)."),
    temperature: float | None = typer.Option(None, min=0, help="(default: 0 (greedy) for one sample, else 1)"),
    max_tokens: int = typer.Option(512, min=1, help="For tasks that carry no sampling of their own."),
    stop: list[str] | None = typer.Option(
        None, "--stop", help="Stop string (repeatable), for tasks that carry no sampling of their own."
    ),
    limit: int | None = typer.Option(None, min=1, help="Evaluate the first this many tasks."),
    engine: str = typer.Option("reference", help="reference | vllm"),
    out: Path | None = typer.Option(None, "--out", help="Write the JSON report here."),
    config: Path | None = CONFIG,
    store: Path = STORE,
) -> None:
    """Held-out pass@1 / pass@k, mean reward and length of a model or a run's policy on a task file."""
    from conveyor.config import RewardConfig, RolloutConfig
    from producers.loaders import RecordRejected, TaskFileError, load_tasks
    from rollout_workers.engines import open_engine
    from rollout_workers.evaluation import evaluate as run_eval
    from sandbox.runner import Sandbox, SandboxUnavailable

    if (model is None) == (run is None):
        fail("give --model or --run (one of them)")
    if engine not in ("reference", "vllm"):
        fail(f"--engine {engine}: reference or vllm")
    if split not in ("heldout", "train", "all"):
        fail(f"--split {split}: heldout, train or all")
    try:
        loaded = load_tasks(data, "eval", preset or "plain", on_error="fail")
    except (RecordRejected, TaskFileError, ValueError) as exc:
        fail(str(exc))
    tasks = loaded.tasks if split == "all" else [t for t in loaded.tasks if t.split == split]
    if not tasks and split == "heldout":
        tasks = loaded.tasks  # a file of held-out tasks only carries no split
    tasks = tasks[:limit] if limit else tasks
    if not tasks:
        fail(f"{data}: no {split} tasks")
    with tempfile.TemporaryDirectory(prefix="conveyor-eval-") as tmp:
        if run is not None:
            from storage.model_export import ExportError, export_model

            try:
                exported = export_model(open_store(config, store), run, Path(tmp) / "model", version=version)
            except ExportError as exc:
                fail(str(exc))
            model_dir = Path(tmp) / "model"
            typer.echo(f"run {run} version {exported['version']}", err=True)
        else:
            model_dir = models.resolved(model)
        try:
            sandbox = Sandbox.from_config(RewardConfig())
        except SandboxUnavailable as exc:
            fail(f"sandbox unavailable: {exc}")
        eng = open_engine(RolloutConfig(engine=engine), model_dir)  # type: ignore[arg-type]

        async def main():
            await eng.start()
            try:
                with progress("eval", len(tasks), unit="tasks") as advance:
                    return await run_eval(
                        eng,
                        sandbox,
                        tasks,
                        k=k,
                        samples=samples,
                        temperature=temperature,
                        max_tokens=max_tokens,
                        stop=tuple(stop or ()),
                        on_task=advance,
                    )
            finally:
                await eng.close()

        try:
            report = asyncio.run(main())
        except ValueError as exc:
            fail(str(exc))
        finally:
            sandbox.close()
    summary = report.summary()
    typer.echo(json.dumps(summary, indent=2))
    for key in ("pass_at_1", "pass_at_k", "mean_reward", "mean_tokens"):
        unit = "tokens" if key == "mean_tokens" else "fraction"
        typer.echo(f"FIGURE eval_{key} {summary[key]:.4f} {unit}")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"data": str(data), "model": model, "run": run, **report.to_json()}, indent=2))
    _track(config, out, summary, {"data": str(data), "model": model, "run": run, "version": version, "split": split,
                                  "k": k, "samples": samples, "temperature": temperature, "engine": engine})  # fmt: skip


def _track(config: Path | None, out: Path | None, summary: dict, args: dict) -> None:
    """The results in the run config's experiment tracker (``tracking:``), if it names one."""
    if config is None:
        return
    from conveyor.config import load_run_config
    from conveyor.tracking import open_tracker

    cfg = load_run_config(config)
    name = f"eval-{args['run'] or Path(str(args['model'])).name}"
    where = (out.parent if out is not None else Path(".")).resolve()
    tracker = open_tracker(cfg.tracking, where, name, {"eval": args, "run_config": cfg.model_dump(mode="json")})
    if tracker is None:
        return
    tracker.log_eval(summary, step=args["version"] or 0)
    tracker.log_model(str(args["model"] or f"run {args['run']} version {args['version'] or 'newest'}"))
    tracker.close()
    if tracker.failures:
        typer.secho(f"the experiment tracker ({cfg.tracking.type}) failed {tracker.failures} times: see the log",
                    fg=typer.colors.YELLOW, err=True)  # fmt: skip
