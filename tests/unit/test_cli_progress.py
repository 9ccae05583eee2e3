"""Long CLI work shows progress on a terminal and stays quiet otherwise."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from launch.cli.progress import progress

pytestmark = pytest.mark.unit


def test_a_terminal_sees_counts_and_status():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=150)
    with progress("sft", 4, unit="steps", console=console) as advance:
        for i in range(4):
            advance(1, status=f"loss {1.0 / (i + 1):.3f}")
    text = out.getvalue()
    assert "sft" in text and "4/4" in text and "loss 0.250" in text


def test_no_terminal_no_output():
    out = io.StringIO()
    with progress("eval", 10, console=Console(file=out, force_terminal=False)) as advance:
        for _ in range(10):
            advance(1, status="x")
    assert out.getvalue() == ""


def test_the_trainer_and_the_evaluator_report_each_step_and_task(tmp_path):
    import asyncio

    from conveyor.config import RolloutConfig
    from conveyor.contracts import Task, VerifierSpec
    from learner.demonstrations import train_sft
    from learner.models import create_tiny_llama
    from rollout_workers.engines import open_engine
    from rollout_workers.evaluation import evaluate
    from tasks.suites.pyexpr import ALPHABET

    model, tok = create_tiny_llama(tmp_path / "m", ALPHABET, hidden_size=32, layers=1, intermediate_size=64)
    steps = []
    examples = [(tok("1+1=").input_ids, tok("2").input_ids)] * 10
    train_sft(model, examples, tok.pad_token_id, epochs=2, batch_size=4, on_step=lambda n, **f: steps.append((n, f)))
    assert len(steps) == 6 and steps[-1][1]["status"].startswith("loss ")  # 2 epochs of 3 batches
    from learner.offline import Pair, train_dpo

    dpo_steps = []
    pairs = [Pair(f"t{i}", tok("1+1=").input_ids, tok("2").input_ids, tok("3").input_ids, 1.0) for i in range(5)]
    train_dpo(model, pairs, tok.pad_token_id, epochs=2, batch_size=2, on_step=lambda n, **f: dpo_steps.append(f["status"]))
    assert len(dpo_steps) == 6 and dpo_steps[-1].startswith("loss ") and "accuracy" in dpo_steps[-1]
    tasks = [Task(task_id=f"t{i}", run_id="e", prompt="1+1=", verifier=VerifierSpec(kind="math", data={"answer": "2"}))
             for i in range(5)]  # fmt: skip
    done = []

    async def main():
        engine = open_engine(RolloutConfig(engine="reference", seed=0), tmp_path / "m")
        await engine.start()
        try:
            return await evaluate(engine, None, tasks, max_tokens=4, on_task=done.append)
        finally:
            await engine.close()

    assert asyncio.run(main()).tasks == 5 and done == [1] * 5
