"""A distributed run on the local stack, every role its own process, under fire:
kill -9 of a random role at random moments (at least 20 kills, every role at
least twice, the supervisor restarting each), S3 stopped for 30 s mid-run
while the kills go on,
and malformed records injected on every topic (and one oversized record). At the end: every task was
rolled out, every rollout scored, every scored rollout is in the lake once,
no rollout was trained on twice, the malformed records are on the
dead-letter topic, and the learner still trained what was generated: at least
80% of the scored samples were trained on or filtered for zero variance (not
dropped as stale), no sample it saw was more than ``max_lag + 1`` versions old,
and no batch that trained nothing published a version."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
import uuid
from collections import Counter

import pytest

from bench.distributed import untrained_versions
from conveyor.contracts import DeadLetter, Rollout, ScoredRollout, Task, decode
from conveyor.topics import Topics

ROLES = ["producer", "rollout-worker-0", "reward-bridge", "reward-worker-0", "learner", "storage-sink"]
TASKS, GROUP, MAX_LAG = 120, 4, 3


def read_topics(kafka_cfg, wanted: dict[str, tuple[str, type]]) -> dict[str, list]:
    """Every decodable record of each topic (``{name: (topic, type)}``), read at once:
    each read waits for its group to join and for 2.5 quiet seconds."""
    from conveyor.transport.kafka import KafkaTransport

    async def one(t, topic: str, typ) -> list:
        c = t.consumer([topic], f"check-{uuid.uuid4().hex[:8]}")
        await c.start()
        out, quiet = [], 0
        while quiet < 5:
            recs = await c.getmany(timeout_s=0.5, max_records=100_000)
            quiet = 0 if recs else quiet + 1
            for r in recs:
                try:
                    out.append(decode(r.value, typ))
                except Exception:  # noqa: BLE001 - the injected garbage
                    pass
        await c.close()
        return out

    async def go() -> dict[str, list]:
        t = KafkaTransport(kafka_cfg)
        try:
            got = await asyncio.gather(*(one(t, topic, typ) for topic, typ in wanted.values()))
        finally:
            await t.close()
        return dict(zip(wanted, got))

    return asyncio.run(go())


def inject_garbage(kafka_cfg, topics: Topics) -> list[str]:
    from conveyor.transport.kafka import KafkaTransport

    names = [topics.tasks, topics.rollouts, topics.scored, topics.weights, topics.progress]

    async def go():
        t = KafkaTransport(kafka_cfg)
        p = t.producer()
        await p.start()
        for name in names:
            await p.send_and_wait(name, b"\x00garbage, not msgpack" + os.urandom(16), b"chaos")
        await p.send_and_wait(topics.rollouts, b"\xc1" + os.urandom(3 << 20), b"chaos-oversized")  # 3 MiB of noise
        await p.close()
        await t.close()

    asyncio.run(go())
    return names


@pytest.mark.timeout(1500)
def test_distributed_run_survives_kills_and_an_s3_outage(stack, kafka_cfg, s3_cfg, redis_url, tmp_path):
    import random as pyrandom

    import torch

    from conveyor.config import parse_run_config
    from conveyor.objectstore import S3ObjectStore
    from launch.demo import DemoConfig, _warmup
    from launch.supervisor import Supervisor, write_run_config
    from learner.checkpoint import load_latest
    from learner.models import create_tiny_llama
    from storage.lake import LakeReader
    from tasks.suites.pyexpr import ALPHABET

    run_id = f"chaos-{uuid.uuid4().hex[:6]}"
    topics = Topics(run_id)
    torch.manual_seed(0)
    model, tok = create_tiny_llama(tmp_path / "model", ALPHABET, seed=0)
    _warmup(model, tok, DemoConfig(warmup_steps=200), pyrandom.Random(0))
    model.save_pretrained(tmp_path / "model")
    prefix = f"{run_id}/"
    data = {
        "run_id": run_id,
        "transport": {**kafka_cfg.model_dump(), "connect_deadline_s": 120},
        "object_store": {
            **s3_cfg.model_dump(mode="json"),
            "prefix": prefix,
            "max_attempts": 2,
            "secret_access_key": s3_cfg.secret_access_key.get_secret_value(),
        },  # fmt: skip
        "celery": {"type": "redis", "url": redis_url, "visibility_timeout_s": 20},
        "reward": {"timeout_s": 2, "soft_time_limit_s": 8, "hard_time_limit_s": 10, "queue": f"{run_id}-reward"},
        "producer": {"suite": "pyexpr", "group_size": GROUP, "max_tasks": TASKS, "http_port": None},
        "learner": {"batch_groups": 4, "max_lag": MAX_LAG, "checkpoint_every": 2, "group_timeout_s": 60},
        "logging": {"level": "info", "format": "json"},
    }
    parse_run_config(data)  # fail here, not in six processes, if the config is wrong
    path = write_run_config(tmp_path / "run", data)
    sup = Supervisor(tmp_path / "run", path, tmp_path / "model")
    injected: list[str] = []
    sup.start()
    rng = random.Random(7)
    kills: Counter[str] = Counter()
    start = time.monotonic()
    outage_started: float | None = None
    outage_done = False
    kills_at_outage = kills_in_outage = 0
    phases: dict[str, float] = {}
    try:
        time.sleep(15)  # every role up (model loads, group joins)
        injected = inject_garbage(kafka_cfg, topics)
        while time.monotonic() - start < 600:
            sup.tick()
            due = [r for r in ROLES if kills[r] < 2 and not sup.roles[r].done]
            if "producer" in due:
                due = ["producer"]  # it finishes its suite early: its two kills come first
            role = (
                rng.choice(due) if due and sum(kills.values()) < 24 else (rng.choice(ROLES) if sum(kills.values()) < 20 else None)
            )
            if role is not None and sup.roles[role].pid:
                os.killpg(sup.roles[role].pid, signal.SIGKILL)
                kills[role] += 1
            if outage_started is None and sum(kills.values()) >= 8:
                stack.kill("s3")  # the outage: at least 30 s, and the kills go on during it
                outage_started, kills_at_outage = time.monotonic(), sum(kills.values())
            elif not outage_done and outage_started is not None and time.monotonic() - outage_started >= 30:
                phases["outage"] = time.monotonic() - outage_started
                kills_in_outage = sum(kills.values()) - kills_at_outage
                stack.restart("s3", 60.0)
                outage_done = True
            for _ in range(rng.randint(4, 10)):  # 2-5 s between kills
                sup.tick()
                time.sleep(0.5)
            if (
                outage_done
                and sum(kills.values()) >= 20
                and all(kills[r] >= 2 or sup.roles[r].done for r in ROLES)
                and sup.roles["producer"].done
            ):
                break
        if not outage_done:  # the loop ran out of time: S3 must serve the drain
            stack.restart("s3", 60.0)
        phases["kills"] = time.monotonic() - start
        # Let the pipeline finish what the producer published, then drain front to back.
        deadline = time.monotonic() + 240
        last, stable = None, 0
        while time.monotonic() < deadline and stable < 12:
            sup.tick()
            time.sleep(1)
            lake = LakeReader(S3ObjectStore(s3_cfg.model_copy(update={"prefix": prefix})), run_id).stats()["rows"]
            stable = stable + 1 if lake == last else 0
            last = lake
        phases["drain"] = time.monotonic() - start - phases["kills"]
    finally:
        stopping = time.monotonic()
        codes = sup.stop(grace_s=90)
        phases["stop"] = time.monotonic() - stopping
    restarts = {n: r.restarts for n, r in sup.roles.items()}

    stopped_at = time.monotonic()
    read = read_topics(kafka_cfg, {"tasks": (topics.tasks, Task), "rollouts": (topics.rollouts, Rollout),
                                   "scored": (topics.scored, ScoredRollout), "dead": (topics.dead_letter, DeadLetter)})  # fmt: skip
    tasks = {t.task_id for t in read["tasks"]}
    rollouts = read["rollouts"]
    scored = {s.rollout_id for s in read["scored"]}
    store = S3ObjectStore(s3_cfg.model_copy(update={"prefix": prefix}))
    lake = [s.rollout_id for s in LakeReader(store, run_id).iter()]
    rolled_tasks = Counter()
    for r in {r.rollout_id: r for r in rollouts}.values():
        rolled_tasks[r.task_id] += 1
    not_rolled = [t for t in tasks if rolled_tasks[t] < GROUP]
    rollout_ids = {r.rollout_id for r in rollouts}
    not_scored = rollout_ids - scored
    not_in_lake = scored - set(lake)
    lost = len(not_rolled) + len(not_scored) + len(not_in_lake)
    ledger = Counter(load_latest(store, run_id)["trained_log"])
    double = sum(1 for n in ledger.values() if n > 1)
    letters = read["dead"]
    dead_lettered = {d.source_topic for d in letters if d.key == b"chaos"}
    oversized = [d for d in letters if d.key == b"chaos-oversized"]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    zero_variance = rows[-1].get("samples_zero_variance", 0) if rows else 0  # counters are checkpointed: the final lineage's
    trained_fraction = (len(ledger) + zero_variance) / max(len(scored), 1)
    max_staleness = max((r.get("max_staleness", 0) for r in rows), default=0)
    phases["checks"] = time.monotonic() - stopped_at
    print(json.dumps({"kills": dict(kills), "restarts": restarts, "exit_codes": codes, "tasks": len(tasks), "rollouts": len(rollout_ids),
                      "scored": len(scored), "lake": len(lake), "trained": len(ledger), "kills_during_outage": kills_in_outage,
                      "trained_fraction": round(trained_fraction, 3), "max_staleness": max_staleness,
                      "phases_s": {k: round(v, 1) for k, v in phases.items()}}))  # fmt: skip
    print(f"FIGURE chaos_kills {sum(kills.values())} count")
    print(f"FIGURE chaos_lost {lost} count")
    print(f"FIGURE chaos_double_trained {double} count")
    from integration.test_lake import foreign_count

    read_rows, distinct = foreign_count(store, run_id)  # the table as Polars reads it: no dedupe of Conveyor's
    print(f"FIGURE chaos_lake_foreign_duplicates {read_rows - distinct} rows ({read_rows} read)")
    assert sum(kills.values()) >= 20 and all(kills[r] >= 2 for r in ROLES), kills
    assert outage_done and kills_in_outage > 0, (outage_done, kills_in_outage)
    assert len(tasks) == TASKS
    assert lost == 0, (not_rolled[:3], sorted(not_scored)[:3], sorted(not_in_lake)[:3])
    assert len(lake) == len(set(lake)) and (read_rows, distinct) == (len(lake), len(lake))
    assert double == 0 and len(ledger) > 0
    assert set(ledger) <= scored
    assert dead_lettered >= set(injected or []), dead_lettered
    assert oversized and all(d.raw_truncated and d.raw_size > 3 << 20 for d in oversized)
    assert trained_fraction >= 0.8, trained_fraction
    assert max_staleness <= MAX_LAG + 1, max_staleness
    assert untrained_versions(rows) == 0  # a batch that trained nothing published no version
