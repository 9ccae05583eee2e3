"""``conveyor train sft|rft|dpo``: supervised fine-tuning on a demonstrations file, and offline
post-training from a run's lake."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from launch.cli import models
from launch.cli.progress import progress
from launch.cli.runs import CONFIG, STORE, open_store

app = typer.Typer(help="Offline recipes that train from the trajectory lake.", no_args_is_help=True)
MODEL = typer.Option(..., "--model", help=f"Starting model. {models.HELP}")
OUT = typer.Option(..., "--out", help="Where to save the trained model (HF format).")


def _load(name: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = models.resolved(name)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model, tok


def _save(model, tok, out: Path, stats: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    (out / "offline_stats.json").write_text(json.dumps(stats, indent=2))
    typer.echo(json.dumps(stats, indent=2))


@app.command("sft")
def sft(
    data: Path = typer.Option(
        ..., "--data", exists=True, dir_okay=False, help="Demonstrations: JSONL or Parquet (prompt/completion or messages)."
    ),
    model: str = MODEL,
    out: Path = OUT,
    epochs: int = typer.Option(1, min=1),
    batch_size: int = typer.Option(16, min=1),
    lr: float = typer.Option(2e-5, min=0.0),
    max_tokens: int | None = typer.Option(None, min=1, help="Refuse demonstrations longer than this (prompt + reply)."),
    on_error: str = typer.Option("fail", help="fail: refuse the file at its first bad record | skip: skip such records"),
    seed: int = typer.Option(0),
) -> None:
    """SFT on your demonstrations, rendered with the model's chat template as the rollout engines render prompts."""
    from learner.demonstrations import demonstrations, train_sft
    from producers.loaders.formats import read_records

    if on_error not in ("fail", "skip"):
        raise typer.BadParameter("fail or skip", param_hint="--on-error")
    m, tok = _load(model)
    raws = list(read_records(data, 1024))
    unreadable = [f"{data}:{r.line if r.line is not None else f'row {r.row}'}: {r.error}" for r in raws if r.error]
    records = [(f"{data}:{r.line if r.line is not None else f'row {r.row}'}", r.record) for r in raws if not r.error]
    examples, bad = demonstrations(records, tok, max_tokens=max_tokens)
    problems = unreadable + [str(b) for b in bad]
    for line in problems[:20]:
        typer.echo(line, err=True)
    if problems and on_error == "fail":
        typer.secho(f"{len(problems)} bad record(s) in {data}; --on-error skip to skip them", fg=typer.colors.RED, err=True)
        raise typer.Exit(2)
    try:
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        steps = epochs * -(-len(examples) // batch_size)
        with progress("sft", steps, unit="steps") as advance:
            stats = train_sft(m, examples, pad, epochs=epochs, batch_size=batch_size, lr=lr, seed=seed, on_step=advance)
    except ValueError as exc:
        typer.secho(str(exc), fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None
    _save(m, tok, out, {**stats, "skipped": len(problems)})


@app.command("rft")
def rft(
    run: str = typer.Argument(..., help="Run whose lake to train on."),
    model: str = MODEL,
    out: Path = OUT,
    epochs: int = typer.Option(2, min=1),
    batch_size: int = typer.Option(32, min=1),
    lr: float = typer.Option(1e-4, min=0.0),
    config: Path | None = CONFIG,
    store: Path = STORE,
) -> None:
    """Rejection-sampling SFT: train on the run's passing trajectories."""
    from learner.offline import passing_examples, rejection_sampling_sft, samples_from_tables
    from storage.lake import LakeFilter, LakeReader

    m, tok = _load(model)
    reader = LakeReader(open_store(config, store), run)
    with reader.leased():  # vacuum keeps the version read
        rows = list(samples_from_tables(reader.iter_tables(LakeFilter(verdicts=frozenset({"pass"})))))
    steps = epochs * -(-len(passing_examples(rows)) // batch_size)
    try:
        with progress("rft", steps, unit="steps") as advance:
            stats = rejection_sampling_sft(
                m, rows, tok.pad_token_id, epochs=epochs, batch_size=batch_size, lr=lr, on_step=advance
            )
    except ValueError as exc:  # nothing passed: nothing to train on
        typer.secho(f"{run}: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None
    _save(m, tok, out, stats)


@app.command("dpo")
def dpo(
    run: str = typer.Argument(..., help="Run whose lake to train on."),
    model: str = MODEL,
    out: Path = OUT,
    epochs: int = typer.Option(1, min=1),
    batch_size: int = typer.Option(16, min=1),
    lr: float = typer.Option(5e-5, min=0.0),
    beta: float = typer.Option(0.1, min=0.0),
    pairs_per_group: int = typer.Option(4, min=1),
    config: Path | None = CONFIG,
    store: Path = STORE,
) -> None:
    """DPO on pairs built inside groups (higher reward chosen, lower rejected)."""
    from learner.offline import dpo_pairs, samples_from_tables, train_dpo
    from storage.lake import LakeReader

    m, tok = _load(model)
    reader = LakeReader(open_store(config, store), run)
    with reader.leased():  # vacuum keeps the version read
        pairs = dpo_pairs(samples_from_tables(reader.iter_tables()), max_pairs_per_group=pairs_per_group)
    try:
        with progress("dpo", epochs * -(-len(pairs) // batch_size), unit="steps") as advance:
            stats = train_dpo(m, pairs, tok.pad_token_id, epochs=epochs, batch_size=batch_size, lr=lr, beta=beta, on_step=advance)
    except ValueError as exc:  # no group had different rewards
        typer.secho(f"{run}: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None
    _save(m, tok, out, stats)
