"""A user's path end to end, every step through the ``conveyor`` command on the real services:
their model (a Hugging Face directory with a chat template), their demonstrations
(``conveyor train sft --data``), their dataset in veRL's layout with chat prompts (the run
config's ``data:`` section, rolled out by vLLM), ``conveyor eval`` before and after, and the
trained policy exported as a model transformers loads (``conveyor runs export-model``).

The held-out margin is set against a learner that does not learn: at lr 1e-12 the exported
policy's greedy held-out pass rate is the SFT model's (a gain of 0.00: the same run with
``LR=1e-12``, docs/BENCHMARKS.md), so a rise of 0.10 is the learner's doing.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

RL_SECONDS = 100  # of training: counted from the learner's first step, not from the roles' start
# ... and at least this many learner steps (about what 100 s gives on an idle machine): the suite
# runs beside other tests, which can slow the steps, and the margin was set for this much training.
RL_MIN_STEPS = 120
RL_LIMIT_S = 400
STARTUP_LIMIT_S = 300  # the roles' start (vLLM's the longest) up to the learner's first step
MARGIN = 0.10  # a learner that does not learn gains 0.00
SFT_STEPS = 500  # of 64 demonstrations each
LR = float(os.environ.get("CONVEYOR_E2E_LR", "5e-4"))
# Renders a conversation as its messages' text: the tiny model's prompts are the pyexpr suite's own.
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def conveyor(*args, timeout: float = 600) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "launch.cli.main", *map(str, args)], capture_output=True, text=True, timeout=timeout
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out.stdout


def figure(stdout: str, name: str) -> float:
    return next(float(line.split()[2]) for line in stdout.splitlines() if line.startswith(f"FIGURE {name} "))


def verl_row(p, index: int, split: str) -> dict:
    return {
        "data_source": "pyexpr",
        "prompt": [{"role": "user", "content": p.prompt}],
        "ability": "code",
        "reward_model": {"ground_truth": str(p.answer), "style": "rule"},
        "extra_info": {"index": index, "split": split},
    }


def write_user_files(work: Path) -> dict[str, Path]:
    """The user's model, demonstrations and dataset, as they would bring them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from learner.models import create_tiny_llama
    from tasks.suites.pyexpr import ALPHABET, heldout_set, sample_problems, warmup_completion

    base = work / "base"
    _, tok = create_tiny_llama(base, ALPHABET, seed=0, heads=3)  # vLLM's CPU attention wants head size 32
    tok.chat_template = TEMPLATE
    tok.save_pretrained(base)
    rng = random.Random(0)
    stream = sample_problems(rng)
    demos = work / "demos.jsonl"
    with demos.open("w") as fh:  # the teacher is wrong on some expressions, as the demo's warm-up
        for _ in range(SFT_STEPS * 64):
            p = next(stream)
            turns = [{"role": "user", "content": p.prompt}, {"role": "assistant", "content": warmup_completion(p, rng, 0.7)}]
            fh.write(json.dumps({"messages": turns}) + "\n")
    held = {p.prompt for p in heldout_set(100)}
    train = [p for p in (next(stream) for _ in range(4000)) if p.prompt not in held]
    pq.write_table(pa.Table.from_pylist([verl_row(p, i, "train") for i, p in enumerate(train)]), work / "train.parquet")
    heldout = [verl_row(p, i, "test") for i, p in enumerate(heldout_set(100))]
    pq.write_table(pa.Table.from_pylist(heldout), work / "test.parquet")
    return {"base": base, "demos": demos, "train": work / "train.parquet", "test": work / "test.parquet"}


def trained_enough(metrics: Path, seconds: float) -> bool:
    if seconds < RL_SECONDS:
        return False
    return seconds >= RL_LIMIT_S or len(metrics.read_text().splitlines()) >= RL_MIN_STEPS


def heldout_pass_rate(model: Path, test: Path, *config: str | Path) -> float:
    out = conveyor("eval", "--model", model, "--data", test, "--preset", "verl", "--max-tokens", 5, "--stop", "\n", *config)
    return figure(out, "eval_pass_at_1")


@pytest.mark.timeout(1500)
def test_sft_then_rl_on_your_data_then_eval(stack, kafka_cfg, s3_cfg, redis_url, tmp_path):
    from bench.distributed import run_config
    from launch.supervisor import Supervisor, write_run_config

    files = write_user_files(tmp_path)
    conveyor("train", "sft", "--data", files["demos"], "--model", files["base"], "--out", tmp_path / "sft",
             "--batch-size", 64, "--lr", "1e-3")  # fmt: skip
    # The SFT model's evaluation runs while the roles start (it reads only the SFT directory).
    evaluating = ThreadPoolExecutor(1)
    before_eval = evaluating.submit(heldout_pass_rate, tmp_path / "sft", files["test"])

    kafka = kafka_cfg.model_dump()
    s3 = {**s3_cfg.model_dump(mode="json"), "secret_access_key": s3_cfg.secret_access_key.get_secret_value()}
    run_id = f"e2e-{uuid.uuid4().hex[:6]}"
    data = run_config(run_id, kafka, s3, redis_url, lr=LR)
    tracking_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"  # the user's MLflow: the learner's run and the eval's
    data.update(
        tracking={"type": "mlflow", "uri": tracking_uri, "project": "e2e"},
        producer={"suite": None, "group_size": 8, "http_port": None},
        data={"files": [str(files["train"])], "preset": "verl", "epochs": 3},
        sampling={"max_tokens": 5, "temperature": 1.0, "stop": ["\n"]},
        rollout={
            "engine": "vllm",
            # Eager: on CPU vLLM's graph capture only costs time (about 40 s of the RL window on a
            # fresh machine, its compile cache empty) and speeds nothing up for a model this small.
            "vllm": {
                "dtype": "float32",
                "max_model_len": 64,
                "kv_cache_mb": 256,
                "memory_utilization": 0.05,
                "enforce_eager": True,
            },
        },
    )
    path = write_run_config(tmp_path / run_id, data)
    conveyor("config", "validate", path)  # reads the data file as the producer will
    sup = Supervisor(tmp_path / run_id, path, tmp_path / "sft", rollout_workers=1, reward_workers=2)
    sup.start()
    started = time.monotonic()
    metrics = tmp_path / run_id / "metrics.jsonl"  # the learner's, a line per step
    first_step: float | None = None
    try:
        # The RL time is the learner's: how long the roles take to start (vLLM's import and engine
        # start are most of a minute on 2 cores, longer on a loaded machine) does not shorten it.
        while first_step is None or not trained_enough(metrics, time.monotonic() - first_step):
            sup.tick()
            time.sleep(0.5)
            if first_step is None and metrics.exists() and metrics.stat().st_size:
                first_step = time.monotonic()
            assert first_step or time.monotonic() - started < STARTUP_LIMIT_S, "no learner step after the roles' start"
    finally:
        codes = sup.stop()
    assert all(code == 0 for code in codes.values()), codes  # every role drained
    before = before_eval.result()
    evaluating.shutdown()

    exported = json.loads(conveyor("runs", "export-model", run_id, tmp_path / "out", "--config", path))
    assert exported["version"] > 10, exported
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert AutoTokenizer.from_pretrained(tmp_path / "out").chat_template == TEMPLATE
    after = heldout_pass_rate(tmp_path / "out", files["test"], "--config", path)
    steps = len(metrics.read_text().splitlines())
    print(json.dumps({"before": before, "after": after, "version": exported["version"], "steps": steps, "lr": LR}))
    assert after - before >= MARGIN, (before, after)
    # The experiment tracker has what metrics.jsonl has, where the policy is, and the eval's result.
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    runs = {r.info.run_name: r for r in client.search_runs([client.get_experiment_by_name("e2e").experiment_id])}
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    history = client.get_metric_history(runs[run_id].info.run_id, "reward_mean")
    # (a batch that trained nothing repeats its step: the two values come back in either order)
    assert sorted((m.step, round(m.value, 6)) for m in history) == sorted((r["step"], round(r["reward_mean"], 6)) for r in rows)
    assert runs[run_id].data.params["learner.lr"] == str(LR) and runs[run_id].data.tags["conveyor.model"].startswith("s3://")
    assert runs["eval-out"].data.metrics["eval.pass_at_1"] == pytest.approx(after)
