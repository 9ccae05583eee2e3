"""A distributed run on the local stack, every role its own process, and what it trained.

    python3 bench/distributed.py                      # 300 s of RL, 2 rollout and 2 reward workers
    python3 bench/distributed.py --seconds 120 --lr 1e-12   # the learner that does not learn

Starts (or reuses) the local stack (Kafka-protocol broker, S3, Redis), runs
``conveyor serve <role>`` for every role under the same supervisor as
``conveyor run``, stops it front to back, then reads what the run left:

- ``dist_trained_fraction``: (samples trained + samples in zero-variance groups)
  / distinct rollouts on the scored topic. The rest were dropped as stale,
  were infrastructure failures, or were still in flight at the stop.
- ``dist_max_staleness``: the largest policy lag the learner saw in any batch,
  dropped samples included.
- ``dist_heldout_gain``: greedy held-out pass rate of the newest published
  weights minus that of the initial policy (the demo's evaluator and held-out set).
- ``bridge_vs_rollout_ratio``: rollouts/s the reward tier scores with a backlog
  (the run's own rollouts republished to a fresh run's topic, the same bridge
  and reward-worker processes, nothing else running) / rollouts/s the rollout
  workers generated in the run.
- ``dist_untrained_versions``: versions published by batches that trained
  nothing (must be 0).

The functions are what tests/integration/test_distributed_learning.py runs,
for a shorter time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MAX_LAG, BATCH_GROUPS, GROUP = 2, 8, 8


def run_config(run_id: str, kafka: dict, s3: dict, redis_url: str, *, lr: float | None = None, max_lag: int = MAX_LAG,
               http_port: int | None = None) -> dict:  # fmt: skip
    learner = {"batch_groups": BATCH_GROUPS, "max_lag": max_lag, "checkpoint_every": 10}
    if lr is not None:
        learner["lr"] = lr
    return {
        "run_id": run_id,
        "transport": {**kafka, "connect_deadline_s": 120},
        "object_store": {**s3, "prefix": f"{run_id}/"},
        "celery": {"type": "redis", "url": redis_url, "visibility_timeout_s": 60},
        "reward": {"timeout_s": 2, "soft_time_limit_s": 20, "hard_time_limit_s": 30, "queue": f"{run_id}-reward"},
        "producer": {"suite": "pyexpr", "group_size": GROUP, "http_port": http_port},
        "learner": learner,
        "logging": {"level": "info", "format": "json"},
    }


def read_topic(kafka: dict, topic: str, typ) -> list:
    """Every decodable record of ``topic``, read by a group of its own until 2.5 quiet seconds."""
    from conveyor.config import KafkaTransportConfig
    from conveyor.contracts import DecodeError, decode
    from conveyor.transport.kafka import KafkaTransport

    async def go() -> list:
        t = KafkaTransport(KafkaTransportConfig(**kafka))
        c = t.consumer([topic], f"bench-{uuid.uuid4().hex[:8]}")
        await c.start()
        out, quiet = [], 0
        try:
            while quiet < 5:
                recs = await c.getmany(timeout_s=0.5, max_records=100_000)
                quiet = 0 if recs else quiet + 1
                for r in recs:
                    try:
                        out.append(decode(r.value, typ))
                    except DecodeError:
                        pass
        finally:
            await c.close()
            await t.close()
        return out

    return asyncio.run(go())


def heldout_pass_rate(model_dir: Path, state: dict | None = None, size: int = 100) -> float:
    """The demo's greedy held-out pass rate of ``model_dir`` (with ``state``'s weights, if given)."""
    from launch.demo import Evaluator
    from rollout_workers.reference_engine import ReferenceEngine
    from sandbox.runner import Sandbox, SandboxLimits
    from tasks.suites.pyexpr import heldout_set, to_task

    engine = ReferenceEngine(model_dir, seed=0)
    if state is not None:
        engine.load_state_dict(state, 1)
    sandbox = Sandbox(SandboxLimits(timeout_s=1.0), warm=True)
    try:
        tasks = [to_task(p, "heldout", 1, i, "heldout") for i, p in enumerate(heldout_set(size))]
        return Evaluator(engine, sandbox, tasks).pass_rate()
    finally:
        sandbox.close()


def newest_weights(store, run_id: str) -> dict | None:
    from safetensors.torch import load

    from conveyor import keys

    versions = sorted(v for i in store.list(keys.weights_prefix(run_id)) if (v := keys.weights_version(i.key)) is not None)
    return load(store.get(keys.weights_key(run_id, versions[-1]))) if versions else None


def learner_figures(rows: list[dict], scored: int) -> dict:
    """What the learner's metrics say about the run (rows of metrics.jsonl, counters cumulative)."""
    last = rows[-1] if rows else {}
    trained = sum(r.get("trained_samples", 0) for r in rows)
    zero_var = last.get("samples_zero_variance", 0)
    return {
        "scored": scored,
        "trained": trained,
        "zero_variance": zero_var,
        "stale_dropped": last.get("samples_stale_dropped", 0),
        "batches_untrained": last.get("batches_untrained", 0),
        "steps": last.get("step", 0),
        "version": last.get("version", 0),
        "trained_fraction": (trained + zero_var) / scored if scored else 0.0,
        "max_staleness": max((r.get("max_staleness", 0) for r in rows), default=0),
        "untrained_versions": untrained_versions(rows),
    }


def untrained_versions(rows: list[dict]) -> int:
    """Rows of metrics.jsonl whose batch trained nothing and yet changed the version. A restarted
    learner appends to the same file (its ``wall_s`` starts again): its first row is compared
    with nothing."""
    count, prev = 0, None
    for r in rows:
        if prev is not None and r["wall_s"] < prev["wall_s"]:
            prev = None
        before = prev["version"] if prev is not None else None
        if not r.get("trained_samples") and before is not None and r["version"] != before:
            count += 1
        prev = r
    return count


def run_distributed(work: Path, kafka: dict, s3: dict, redis_url: str, *, seconds: float, rollout_workers: int = 2,
                    reward_workers: int = 2, lr: float | None = None, warmup_steps: int = 800,
                    metrics_port_base: int | None = None, http_port: int | None = None, hooks=None,
                    min_steps: int = 0, max_seconds: float | None = None) -> dict:  # fmt: skip
    """One run of ``seconds`` of RL; returns its figures (and the run's config and model).

    ``min_steps``: the run goes on past ``seconds`` until the learner has logged that many steps
    (on a loaded machine the roles start and step slower), for at most ``max_seconds`` in all.

    ``metrics_port_base``: every role serves Prometheus metrics from that port on; ``http_port``:
    the producer's HTTP API; ``hooks``: an object whose ``started(supervisor, run_id)`` is called
    once the roles started and ``tick(elapsed_s)`` every half second (a test watching the run)."""
    from conveyor.config import parse_run_config
    from conveyor.contracts import Rollout, ScoredRollout
    from conveyor.topics import Topics
    from launch.demo import warmed_tiny_policy
    from launch.supervisor import Supervisor, write_run_config

    model_dir = warmed_tiny_policy(work / "model", warmup_steps)
    run_id = f"dist-{uuid.uuid4().hex[:6]}"
    data = run_config(run_id, kafka, s3, redis_url, lr=lr, http_port=http_port)
    cfg = parse_run_config(data)
    path = write_run_config(work / run_id, data)
    sup = Supervisor(work / run_id, path, model_dir, rollout_workers=rollout_workers, reward_workers=reward_workers,
                     metrics_port_base=metrics_port_base)  # fmt: skip
    sup.start()
    started = time.monotonic()
    try:
        if hooks is not None:
            hooks.started(sup, run_id)
        steps_log = work / run_id / "metrics.jsonl"
        limit = max_seconds if max_seconds is not None else seconds * 5

        def going_on() -> bool:
            elapsed = time.monotonic() - started
            if elapsed < seconds:
                return True
            steps = len(steps_log.read_text().splitlines()) if steps_log.exists() else 0
            return steps < min_steps and elapsed < limit

        while going_on():
            sup.tick()
            if hooks is not None:
                hooks.tick(time.monotonic() - started)
            time.sleep(0.5)
    finally:
        codes = sup.stop()
    elapsed = time.monotonic() - started
    topics = Topics(run_id)
    scored = {s.rollout_id for s in read_topic(kafka, topics.scored, ScoredRollout)}
    rollouts = {r.rollout_id: r for r in read_topic(kafka, topics.rollouts, Rollout)}
    rows = [json.loads(line) for line in (work / run_id / "metrics.jsonl").read_text().splitlines() if line.strip()]
    figures = learner_figures(rows, len(scored))
    from conveyor.objectstore import S3ObjectStore

    store = S3ObjectStore(cfg.object_store)
    start_rate = heldout_pass_rate(model_dir)
    state = newest_weights(store, run_id)
    end_rate = heldout_pass_rate(model_dir, state) if state is not None else start_rate
    figures.update(
        run_id=run_id, seconds=round(elapsed, 1), exit_codes=codes, restarts={n: r.restarts for n, r in sup.roles.items()},
        rollouts=len(rollouts), generated_per_s=len(rollouts) / elapsed, heldout_start=start_rate, heldout_end=end_rate,
        heldout_gain=end_rate - start_rate, model_dir=str(model_dir), config=str(path),
    )  # fmt: skip
    figures["_rollouts"] = list(rollouts.values())
    return figures


def bridge_rate(work: Path, kafka: dict, s3: dict, redis_url: str, rollouts: list, *, reward_workers: int = 2,
                tokenizer_dir: Path, limit: int = 3000) -> float:  # fmt: skip
    """Rollouts/s the bridge and ``reward_workers`` Celery workers score from a backlog: ``rollouts``
    republished to a fresh run's topic, then timed from the first scored to the last."""
    from conveyor.config import KafkaTransportConfig
    from conveyor.contracts import ScoredRollout, encode
    from conveyor.topics import Topics
    from conveyor.transport.kafka import KafkaTransport
    from launch.supervisor import write_run_config

    rollouts = rollouts[:limit]
    run_id = f"bridge-{uuid.uuid4().hex[:6]}"
    data = run_config(run_id, kafka, s3, redis_url)
    path = write_run_config(work / run_id, data)
    topics = Topics(run_id)

    async def publish() -> None:
        t = KafkaTransport(KafkaTransportConfig(**kafka))
        await t.create_topics(topics.specs(KafkaTransportConfig(**kafka).partitions))
        p = t.producer()
        await p.start()
        acks = [await p.send(topics.rollouts, encode(r), r.task_id.encode()) for r in rollouts]
        await asyncio.gather(*acks)
        await p.close()
        await t.close()

    asyncio.run(publish())
    serve = [sys.executable, "-m", "launch.cli.main", "serve"]
    logs = work / run_id / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    procs = [subprocess.Popen([*serve, "reward-worker", "--config", str(path), "--concurrency", "1", "--hostname", f"b{i}@%h"],
                              stdout=(logs / f"reward-worker-{i}.log").open("w"), stderr=subprocess.STDOUT,
                              start_new_session=True) for i in range(reward_workers)]  # fmt: skip
    time.sleep(8)  # the Celery workers are up before the bridge starts taking the backlog
    procs.append(
        subprocess.Popen(
            [*serve, "reward-bridge", "--config", str(path), "--tokenizer", str(tokenizer_dir)],
            stdout=(logs / "reward-bridge.log").open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    )
    try:
        return _scored_rate(kafka, topics.scored, len(rollouts), ScoredRollout)
    finally:
        for p in procs:
            os.killpg(p.pid, 15)
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, 9)


def _scored_rate(kafka: dict, topic: str, want: int, typ, deadline_s: float = 600.0) -> float:
    from conveyor.config import KafkaTransportConfig
    from conveyor.contracts import decode
    from conveyor.transport.kafka import KafkaTransport

    async def go() -> float:
        t = KafkaTransport(KafkaTransportConfig(**kafka))
        c = t.consumer([topic], f"bench-{uuid.uuid4().hex[:8]}")
        await c.start()
        seen: set[str] = set()
        first = None
        until = time.monotonic() + deadline_s
        try:
            while len(seen) < want and time.monotonic() < until:
                for r in await c.getmany(timeout_s=0.5, max_records=10_000):
                    seen.add(decode(r.value, typ).rollout_id)
                    first = first or time.monotonic()
        finally:
            await c.close()
            await t.close()
        if len(seen) < want or first is None:
            raise RuntimeError(f"the bridge scored {len(seen)} of {want} rollouts within {deadline_s:g} s")
        return (want - 1) / max(time.monotonic() - first, 1e-9)

    return asyncio.run(go())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=300.0, help="seconds of RL before the stop")
    ap.add_argument("--rollout-workers", type=int, default=2)
    ap.add_argument("--reward-workers", type=int, default=2)
    ap.add_argument(
        "--lr", type=float, default=None, help="learner lr (default: the config's; 1e-12: a learner that does not learn)"
    )
    ap.add_argument("--no-bridge-rate", action="store_true", help="skip the bridge's backlog measurement")
    ap.add_argument("--work", type=Path, default=Path("runs/bench-distributed"))
    args = ap.parse_args()

    from launch.stack.components import LOCAL_S3_ACCESS_KEY, LOCAL_S3_SECRET_KEY
    from launch.stack.manager import Stack, pid_alive

    st = Stack(None)
    if not {"kafka", "s3", "redis"} <= {n for n, c in st.read_state().items() if pid_alive(c.pid)}:
        st.up(["kafka", "s3", "redis"], timeout_s=90)  # as `conveyor run` does: reuse a running stack
    ends = st.endpoints()
    kafka = {"type": "kafka", "bootstrap_servers": ends["kafka"]}
    s3 = {"type": "s3", "endpoint_url": ends["s3"], "bucket": "conveyor", "access_key_id": LOCAL_S3_ACCESS_KEY,
          "secret_access_key": LOCAL_S3_SECRET_KEY}  # fmt: skip
    args.work.mkdir(parents=True, exist_ok=True)
    fig = run_distributed(args.work, kafka, s3, ends["redis"], seconds=args.seconds, rollout_workers=args.rollout_workers,
                          reward_workers=args.reward_workers, lr=args.lr)  # fmt: skip
    rollouts = fig.pop("_rollouts")
    if not args.no_bridge_rate:
        rate = bridge_rate(args.work, kafka, s3, ends["redis"], rollouts, reward_workers=args.reward_workers,
                           tokenizer_dir=Path(fig["model_dir"]))  # fmt: skip
        fig["bridge_scored_per_s"] = rate
        fig["bridge_vs_rollout_ratio"] = rate / max(fig["generated_per_s"], 1e-9)
    print(json.dumps(fig, default=str))
    print(f"FIGURE dist_trained_fraction {fig['trained_fraction']:.3f} fraction")
    print(f"FIGURE dist_max_staleness {fig['max_staleness']} versions")
    print(f"FIGURE dist_heldout_gain {fig['heldout_gain']:.3f} fraction")
    print(f"FIGURE dist_untrained_versions {fig['untrained_versions']} count")
    if "bridge_vs_rollout_ratio" in fig:
        print(f"FIGURE bridge_vs_rollout_ratio {fig['bridge_vs_rollout_ratio']:.2f} x")


if __name__ == "__main__":
    main()
