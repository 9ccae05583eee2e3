"""`conveyor serve learner` on two ranks (torchrun, gloo on CPU, FSDP2) against the
real broker trains like one process on the same batches: the same loss and
gradient norm every step, the same published weights within tolerance, the
same rollouts in its ledger; its checkpoint (gathered from both ranks) loads
into a single-process model. The two ranks as one context-parallel group
(``learner.context_parallel: 2``, every pack split between them) train the same."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
import torch
import yaml
from conftest import ROOT, free_port_block
from scored_factory import scored_group

from conveyor.messaging import Publisher
from conveyor.topics import Topics

GROUPS, GROUP_SIZE, BATCH_GROUPS = 16, 4, 4
STEPS = GROUPS // BATCH_GROUPS


def publish(kafka_cfg, run_id: str, rows) -> None:
    from conveyor.transport.kafka import KafkaTransport

    async def go():
        transport = KafkaTransport(kafka_cfg)
        topics = Topics(run_id)
        await transport.create_topics(topics.specs(kafka_cfg.partitions))
        producer = transport.producer()
        await producer.start()
        pub = Publisher(producer, topics.scored)
        # One key: one partition, so both learners see the groups in the same order.
        await asyncio.gather(*[await pub.publish(r, "all") for r in rows])
        await producer.close()
        await transport.close()

    asyncio.run(go())


def train(tmp_path, kafka_cfg, model_dir, name: str, nproc: int, context_parallel: int = 1) -> tuple[str, list[dict]]:
    run_id = f"ranks-{name}-{uuid.uuid4().hex[:6]}"
    # Lengths vary so the two ranks get different pack counts (empty passes are exercised).
    rows = [r for g in range(GROUPS) for r in scored_group(run_id, g, GROUP_SIZE, length=3 + (g * 7) % 23)]
    publish(kafka_cfg, run_id, rows)
    cfg = {
        "run_id": run_id,
        "transport": kafka_cfg.model_dump(),
        "object_store": {"type": "local", "root": str(tmp_path / "objects")},
        "learner": {"batch_groups": BATCH_GROUPS, "max_lag": 100000, "checkpoint_every": 2, "lr": 1e-3,
                    "objective": "decoupled", "pack_tokens": 64, "context_parallel": context_parallel},
        "logging": {"level": "info", "format": "json"},
    }  # fmt: skip
    config = tmp_path / f"{name}.yaml"
    config.write_text(yaml.safe_dump(cfg))
    serve = ["-m", "launch.cli.main", "serve", "learner", "--config", str(config), "--model", str(model_dir),
             "--run-dir", str(tmp_path / name), "--threads", "1"]  # fmt: skip
    if nproc > 1:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={nproc}",
            f"--master-port={free_port_block()}",
            *serve,
        ]
    else:
        cmd = [sys.executable, *serve]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    log = tmp_path / f"{name}.log"
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)
    metrics = tmp_path / name / "metrics.jsonl"
    deadline = time.monotonic() + 240
    rows_seen: list[dict] = []
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists():
            rows_seen = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
            if len(rows_seen) >= STEPS:
                break
        time.sleep(0.3)
    assert len(rows_seen) >= STEPS, log.read_text()[-4000:]
    os.killpg(proc.pid, signal.SIGTERM)  # a clean stop: rank 0 checkpoints with every rank, then all exit
    rc = proc.wait(90)
    text = log.read_text()
    assert "learner.resumed" not in text
    if nproc == 1:
        assert rc == 0, text[-4000:]
    else:  # torchrun itself reports the signal; its ranks must have finished on their own (no SIGKILL)
        assert "forcefully exiting" not in text, text[-4000:]
    return run_id, rows_seen


@pytest.mark.timeout(600)
def test_two_ranks_train_like_one(stack, kafka_cfg, tmp_path):
    from safetensors.torch import load

    from conveyor.objectstore import LocalObjectStore
    from learner.checkpoint import load_latest
    from learner.distributed import load_full_state
    from learner.models import create_tiny_llama
    from tasks.suites.pyexpr import ALPHABET

    create_tiny_llama(tmp_path / "model", ALPHABET, seed=0)
    one_id, one = train(tmp_path, kafka_cfg, tmp_path / "model", "one", 1)
    two_id, two = train(tmp_path, kafka_cfg, tmp_path / "model", "two", 2)
    # The same two ranks as one context-parallel group: every pack split between them (ring attention).
    cp_id, cp = train(tmp_path, kafka_cfg, tmp_path / "model", "cp", 2, context_parallel=2)
    for other in (two, cp):
        for a, b in zip(one[:STEPS], other[:STEPS]):
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-6), (a, b)
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4), (a, b)
            assert b["tokens"] == a["tokens"] and b["trained_samples"] == a["trained_samples"]
    for a, b in zip(one[:STEPS], two[:STEPS]):
        assert b["importance_mean"] == pytest.approx(a["importance_mean"], rel=1e-4)
    assert any(r["micro_batches"] > 1 for r in two[:STEPS])
    assert all("cp_pad_tokens" in r for r in cp[:STEPS])

    store = LocalObjectStore(tmp_path / "objects")
    one_state, two_state = load_latest(store, one_id), load_latest(store, two_id)
    assert one_state["step"] == two_state["step"] >= STEPS
    assert sorted(two_state["trained_log"]) == sorted(one_state["trained_log"])
    assert len(two_state["trained_log"]) == GROUPS * GROUP_SIZE

    # The weights each published last: the same model (Adam normalises each update, so allow a few ulps' drift).
    def weights(run_id: str, version: int) -> dict:
        return load(store.get(f"runs/{run_id}/weights/v{version:06d}/model.safetensors"))

    w1, w2 = weights(one_id, STEPS), weights(two_id, STEPS)
    assert w1.keys() == w2.keys() and "lm_head.weight" not in w2  # tied head stored once, as HF does
    worst = max(float((w1[k] - w2[k]).abs().max()) for k in w1)
    assert worst < 1e-4, worst
    w_cp = weights(cp_id, STEPS)  # published in the same format
    assert w_cp.keys() == w1.keys() and max(float((w1[k] - w_cp[k]).abs().max()) for k in w1) < 1e-4
    assert load_latest(store, cp_id)["step"] >= STEPS

    # The two-rank checkpoint (gathered from both ranks' shards) loads into one process.
    model, _ = create_tiny_llama(tmp_path / "fresh", ALPHABET, seed=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)  # as the learner's (it adds initial_lr)
    load_full_state(model, optimizer, two_state["model"], two_state["optimizer"])
    loaded = model.state_dict()
    assert max(float((loaded[k] - w2[k]).abs().max()) for k in w2) == 0.0
    assert optimizer.state, "optimizer moments restored"
