"""A learner killed with SIGKILL (three times) and restarted resumes from its
newest checkpoint and, in the final model's lineage, trains on every rollout
exactly once (checked by id against the checkpoint's ledger). On one process,
and on two ranks under torchrun with rank 0 killed (torchrun then ends the
other rank; the restarted pair resumes from the checkpoint both wrote), in
both checkpoint layouts (``full``: gathered on rank 0; ``sharded``: each rank's own)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter

import pytest
import yaml
from conftest import ROOT, free_port_block
from scored_factory import scored_group

from conveyor.messaging import Publisher
from conveyor.topics import Topics

GROUPS, GROUP_SIZE, BATCH_GROUPS = 60, 4, 2


def rank0_of(torchrun: subprocess.Popen, timeout_s: float = 60.0) -> int:
    """The pid of torchrun's worker with RANK=0."""
    import psutil

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for child in psutil.Process(torchrun.pid).children():
            try:
                if child.environ().get("RANK") == "0":
                    return child.pid
            except psutil.Error:
                continue
        time.sleep(0.1)
    raise AssertionError("torchrun started no rank 0")


@pytest.mark.timeout(900)  # its own deadlines (three kill cycles of up to 120 s, 180 s to finish) pass the default
@pytest.mark.parametrize("ranks, layout", [(1, "full"), (2, "full"), (2, "sharded")])
def test_learner_killed_three_times_trains_each_rollout_once(stack, kafka_cfg, tmp_path, ranks, layout):
    from conveyor.objectstore import LocalObjectStore
    from conveyor.transport.kafka import KafkaTransport
    from learner.checkpoint import load_latest
    from learner.models import create_tiny_llama
    from tasks.suites.pyexpr import ALPHABET

    run_id = f"resume-{uuid.uuid4().hex[:6]}"
    create_tiny_llama(tmp_path / "model", ALPHABET, seed=0)
    cfg = {
        "run_id": run_id,
        "transport": kafka_cfg.model_dump(),
        "object_store": {"type": "local", "root": str(tmp_path / "objects")},
        "learner": {
            "batch_groups": BATCH_GROUPS,
            "max_lag": 100000,
            "checkpoint_every": 3,
            "lr": 1e-4,
            "checkpoint_layout": layout,
        },
        "logging": {"level": "info", "format": "json"},
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    store = LocalObjectStore(tmp_path / "objects")
    topics = Topics(run_id)
    rows = [r for g in range(GROUPS) for r in scored_group(run_id, g, GROUP_SIZE)]

    def publish_slowly():
        async def go():
            transport = KafkaTransport(kafka_cfg)
            await transport.create_topics(topics.specs(kafka_cfg.partitions))
            producer = transport.producer()
            await producer.start()
            pub = Publisher(producer, topics.scored)
            for i in range(0, len(rows), GROUP_SIZE * BATCH_GROUPS):
                await asyncio.gather(*[await pub.publish(r, r.rollout.task_id) for r in rows[i : i + GROUP_SIZE * BATCH_GROUPS]])
                await asyncio.sleep(0.6)
            await producer.close()
            await transport.close()

        asyncio.run(go())

    def latest_step() -> int:
        try:
            import json

            return json.loads(store.get(f"runs/{run_id}/checkpoints/latest.json"))["step"]
        except Exception:  # noqa: BLE001 - not written yet
            return 0

    def learner():
        serve = ["-m", "launch.cli.main", "serve", "learner", "--config", str(tmp_path / "run.yaml"),
                 "--model", str(tmp_path / "model"), "--run-dir", str(tmp_path / "run"), "--threads", "1"]  # fmt: skip
        if ranks > 1:
            serve = ["-m", "torch.distributed.run", f"--nproc-per-node={ranks}", f"--master-port={free_port_block()}", *serve]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        return subprocess.Popen([sys.executable, *serve], stdout=(tmp_path / "learner.log").open("a"), stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)  # fmt: skip

    publisher = threading.Thread(target=publish_slowly)
    publisher.start()
    kills, steps_at_kill = 0, []
    try:
        for _ in range(3):
            proc = learner()
            start = latest_step()
            deadline = time.monotonic() + 120
            while latest_step() < start + 3 and time.monotonic() < deadline and proc.poll() is None:
                time.sleep(0.1)
            time.sleep(0.4)  # land somewhere between checkpoints
            assert proc.poll() is None, "the learner ended before its kill:\n" + (tmp_path / "learner.log").read_text()[-6000:]
            if ranks == 1:
                proc.send_signal(signal.SIGKILL)
                assert proc.wait(10) == -signal.SIGKILL
            else:  # rank 0 dies; torchrun must end the other rank and exit with an error
                os.kill(rank0_of(proc), signal.SIGKILL)
                assert proc.wait(60) != 0
            kills += 1
            steps_at_kill.append(latest_step())
        publisher.join(120)
        final = learner()
        want = GROUPS // BATCH_GROUPS
        deadline = time.monotonic() + 180
        while latest_step() < want and time.monotonic() < deadline:
            time.sleep(0.2)
        os.killpg(final.pid, signal.SIGTERM)  # torchrun passes it on; rank 0 checkpoints with every rank
        rc = final.wait(90)
        assert rc == 0 or ranks > 1, (tmp_path / "learner.log").read_text()[-3000:]  # torchrun reports the signal itself
    finally:
        publisher.join(1)
    state = load_latest(store, run_id)
    counts = Counter(state["trained_log"])
    double = [i for i, n in counts.items() if n > 1]
    missing = {r.rollout_id for r in rows} - set(counts)
    print(f"FIGURE learner_kills {kills} count; checkpoints at kill {steps_at_kill}; final step {state['step']}")
    assert kills == 3 and not double and not missing, (double[:5], sorted(missing)[:5])
    assert state["step"] == want
    log_text = (tmp_path / "learner.log").read_text()
    assert log_text.count("learner.resumed") >= 3
    shards = [i.key for i in store.list(f"runs/{run_id}/checkpoints/") if ".rank-" in i.key]
    assert bool(shards) == (layout == "sharded"), shards  # each rank wrote its own, or none did
