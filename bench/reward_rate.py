"""How fast the reward tier scores a trivial registered Python reward: the reward bridge taking a
backlog of rollouts, a Celery worker on Redis scoring them (``reward.verifiers``), the verdicts
published, timed from the bridge's start to the last published.

    python3 bench/reward_rate.py                # 20,000 rollouts, batched (64 per task) and one per task

- ``reward_callable_rate``: rollouts/s with ``reward.batch_size`` 64 (the default). Goal:
  >= 5,000/s on 2 cores, so the reward tier never holds back a rollout tier making ~1,300/s.
- ``reward_batching_speedup``: the same against ``batch_size`` 1 (one Celery task per rollout,
  how sandbox kinds travel), measured in the same run on fewer rollouts.

The bridge's topics are in memory (``conveyor/transport/memory.py``): what is measured is the
reward tier (bridge, scorer, Celery, Redis, the worker), not the broker, whose own rate is
``transport_ratio``'s. One worker process of concurrency 2 shares the two cores with the bridge.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def length_reward(prompts, completions, **fields):
    """A trivial reward, TRL's signature: 1 for a completion of the target length, else 0."""
    return [1.0 if len(c) == t else 0.0 for c, t in zip(completions, fields["target"])]


def _rollouts(run_id: str, n: int) -> list:
    from conveyor.contracts import (
        Rollout,
        Task,
        VerifierSpec,
        VersionSegment,
        float32_array,
        int32_array,
        rollout_id,
        uint8_array,
    )

    out = []
    for i in range(n // 8):
        task = Task(task_id=f"t{i}", run_id=run_id, prompt="p", group_size=8,
                    verifier=VerifierSpec(kind="bench_len", data={"target": 3}))  # fmt: skip
        for j in range(8):
            ids = list(b"abc" if j % 2 else b"ab")
            out.append(Rollout(
                rollout_id=rollout_id(task.task_id, j), task_id=task.task_id, run_id=run_id, sample_index=j,
                group_size=8, prompt_token_ids=int32_array([1, 2]), completion_token_ids=int32_array(ids),
                behaviour_logprobs=float32_array([-0.1] * len(ids)), loss_mask=uint8_array([1] * len(ids)),
                version_segments=[VersionSegment(start=0, end=len(ids), policy_version=0)], task=task,
            ))  # fmt: skip
    return out


def write_config(path: Path, redis_url: str, queue: str, batch_size: int) -> Path:
    cfg = {
        "run_id": queue,
        "celery": {"type": "redis", "url": redis_url, "visibility_timeout_s": 120},
        "reward": {"queue": queue, "batch_size": batch_size, "verifiers": {"bench_len": "bench.reward_rate:length_reward"}},
        "bridge": {"max_batch": 512, "max_inflight": 4096},
        "logging": {"level": "warning", "format": "json"},
    }
    path.write_text(yaml.safe_dump(cfg))
    return path


def start_worker(config: Path, log: Path, concurrency: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "launch.cli.main", "serve", "reward-worker", "--config", str(config),
         "--concurrency", str(concurrency)],
        cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    return proc


def stop_worker(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


async def _drain(config: Path, n: int) -> tuple[float, dict[str, int]]:
    """Seconds for the bridge to score a backlog of ``n`` rollouts, and the verdicts it published."""
    from collections import Counter

    from conveyor.config import load_run_config
    from conveyor.contracts import ScoredRollout, decode
    from conveyor.messaging import Publisher
    from conveyor.topics import Topics
    from conveyor.transport.memory import MemoryBroker, MemoryTransport
    from reward.bridge import RewardBridge
    from reward.build import scorer
    from tasks import registry

    cfg = load_run_config(config)
    registry.configure(cfg.reward.verifiers)
    transport = MemoryTransport(MemoryBroker(), partitions=4)
    topics = Topics(cfg.run_id)
    await transport.create_topics(topics.specs(4))
    producer = transport.producer()
    await producer.start()
    pub = Publisher(producer, topics.rollouts)
    acks = [await pub.publish(r, r.task_id) for r in _rollouts(cfg.run_id, n)]
    await asyncio.gather(*acks)
    s = scorer(cfg)
    # Warm: the worker's first task imports the reward and connects; not part of the rate.
    warm = s.score([(r.task, "abc", f"warm-{uuid.uuid4().hex}") for r in _rollouts(cfg.run_id, 8)])
    try:
        await asyncio.wait_for(warm, 90)
    except TimeoutError:
        raise RuntimeError("the reward worker scored nothing in 90 s (see its log)") from None
    bridge = RewardBridge(transport, topics, s, lambda ids: bytes(ids).decode(), cfg.bridge)
    stop = asyncio.Event()
    stop.set()  # drain what is there, then return
    t0 = time.perf_counter()
    await bridge.run(stop)
    elapsed = time.perf_counter() - t0
    s.close()
    sub = transport.consumer([topics.scored], "check")
    await sub.start()
    verdicts: Counter[str] = Counter()
    seen: set[str] = set()
    for _ in range(50):
        recs = await sub.getmany(timeout_s=0.05, max_records=100_000)
        for rec in recs:
            sr = decode(rec.value, ScoredRollout)
            if sr.rollout.rollout_id not in seen:
                seen.add(sr.rollout.rollout_id)
                verdicts[sr.verdict] += 1
        if len(seen) >= n:
            break
    await producer.close()
    if len(seen) != n:
        raise RuntimeError(f"the bridge published {len(seen)} of {n} rollouts")
    return elapsed, dict(verdicts)


def measure(redis_url: str, work: Path, n: int, batch_size: int, concurrency: int = 2) -> dict:
    queue = f"rate-{uuid.uuid4().hex[:8]}"
    config = write_config(work / f"{queue}.yaml", redis_url, queue, batch_size)
    worker = start_worker(config, work / f"{queue}.log", concurrency)
    try:
        elapsed, verdicts = asyncio.run(_drain(config, n))
    finally:
        stop_worker(worker)
    return {"rollouts": n, "batch_size": batch_size, "seconds": elapsed, "per_s": n / elapsed, "verdicts": verdicts}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rollouts", type=int, default=20_000)
    ap.add_argument("--baseline-rollouts", type=int, default=3_000)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--work", type=Path, default=None, help="keep the configs and the workers' logs here")
    args = ap.parse_args()

    from launch.stack.manager import Stack, StackPorts, free_port_block

    with tempfile.TemporaryDirectory(prefix="reward-rate-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        st = Stack(work / "stack", StackPorts.from_base(free_port_block()))
        st.up(["redis"], timeout_s=30)
        try:
            url = st.endpoints()["redis"]
            batched = measure(url, work, args.rollouts, 64, args.concurrency)
            single = measure(url, work, args.baseline_rollouts, 1, args.concurrency)
        finally:
            st.down(grace_s=3)
    print(batched)
    print(single)
    print(f"FIGURE reward_callable_rate {batched['per_s']:.0f} per_s")
    print(f"FIGURE reward_batching_speedup {batched['per_s'] / single['per_s']:.2f} x")


if __name__ == "__main__":
    main()
