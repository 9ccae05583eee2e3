"""Trajectory lake throughput, in one run against the local stack (tansu + SeaweedFS).

1. Sink: N scored rollouts of 2,048 completion tokens are published to the
   scored topic first; then the storage sink (the service's own code:
   consume, decode, Parquet, put to S3, Delta commit with offsets, Kafka
   commit) is timed until every rollout is in the table. Reported in
   rollouts/s, against the demo's rollout rate (``--demo-rate``, the steady
   rate `conveyor demo` reports, measured on the same machine; see
   docs/BENCHMARKS.md), and against plain boto3 puts of the same files'
   bytes to the same server with the same concurrency (``sink_vs_put_ratio``).
2. Replay: the lake's parts are read back as ``ScoredRollout`` objects by
   ``LakeReader.iter`` (GET + Parquet decode + struct construction, 4 parts
   in flight) and as Arrow tables by ``LakeReader.iter_tables`` (GET +
   Parquet decode + filter), against raw boto3 GETs of the same
   objects with the same concurrency (bytes only, nothing decoded).
3. CPU accounting: for each stage, CPU time of this process ("client"), of
   the broker and of the S3 server (psutil) per rollout or per part.
   On a 2-core machine running all three, the ratios are CPU ratios.

    python bench/storage.py [--n 20000] [--tokens 2048] [--rounds 3] [--demo-rate 1000] [--sink-inflight 2]

``--n``: the sink is timed from its first polled record to its last stored part, so a short
run is mostly the pipeline filling and draining (two flushes in flight, the last one with
nothing to overlap): 4,000 rollouts measured 2,500-3,300/s and 16,000-30,000 measured
3,700-4,900/s in the same hour. The default is a steady-state run.

Ends with ``FIGURE sink_rollouts_per_s``, ``sink_vs_demo_ratio``, ``sink_vs_put_ratio`` and ``replay_vs_raw_ratio``.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Import from the repository root, not bench/ (bench/storage.py would shadow the `storage` package).
sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import asyncio
import statistics
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor


class CpuMeter:
    """CPU seconds spent by this process and each named server process between two reads."""

    def __init__(self, pids: dict[str, int]) -> None:
        import psutil

        self.procs = {"client": psutil.Process()} | {name: psutil.Process(pid) for name, pid in pids.items()}

    def read(self) -> dict[str, float]:
        return {name: (lambda t: t.user + t.system)(p.cpu_times()) for name, p in self.procs.items()}

    @staticmethod
    def per(a: dict[str, float], b: dict[str, float], n: int, unit: float = 1e3) -> str:
        return ", ".join(f"{k} {(b[k] - a[k]) / n * unit:.1f}" for k in a)


def make_rows(run_id: str, n: int, tokens: int):
    import numpy as np

    from conveyor.contracts import Rollout, ScoredRollout, Task, VersionSegment, float32_array, int32_array, uint8_array

    rng = np.random.default_rng(0)
    task = Task(task_id="t", run_id=run_id, prompt="x" * 200, group_size=8)
    rows = []
    for i in range(n):
        ids = rng.integers(0, 32000, tokens, dtype=np.int32)
        lps = (-rng.exponential(1.0, tokens)).astype(np.float32)
        r = Rollout(
            rollout_id=f"{run_id}-{i}", task_id=f"t{i // 8}", run_id=run_id, sample_index=i % 8, group_size=8,
            prompt_token_ids=int32_array(range(64)), completion_token_ids=int32_array(ids),
            behaviour_logprobs=float32_array(lps), loss_mask=uint8_array(np.ones(tokens, np.uint8)),
            version_segments=[VersionSegment(start=0, end=tokens, policy_version=i // 1000)], task=task,
        )  # fmt: skip
        rows.append(ScoredRollout(rollout=r, reward=float(i % 2), verdict="pass" if i % 2 else "fail", completion_text="y" * 400))
    return rows


async def publish_rows(kafka_cfg, run_id: str, rows) -> None:
    from conveyor.messaging import Publisher
    from conveyor.topics import Topics
    from conveyor.transport.kafka import KafkaTransport

    topics = Topics(run_id)
    transport = KafkaTransport(kafka_cfg)
    await transport.create_topics(topics.specs(kafka_cfg.partitions))
    producer = transport.producer()
    await producer.start()
    pub = Publisher(producer, topics.scored)
    futs = [await pub.publish(r, r.rollout.task_id) for r in rows]
    await asyncio.gather(*futs)
    await producer.close()
    await transport.close()


async def sink_rate(kafka_cfg, store, run_id: str, n: int, max_inflight: int = 2, meter: CpuMeter | None = None) -> float:
    from conveyor.config import SinkConfig
    from conveyor.topics import Topics
    from conveyor.transport.kafka import KafkaTransport
    from storage.sink import StorageSink

    transport = KafkaTransport(kafka_cfg)
    sink = StorageSink(transport, Topics(run_id), store, SinkConfig(flush_rows=512, flush_s=1.0, max_inflight=max_inflight))
    stop = asyncio.Event()
    stop.set()  # drain what is there, then return
    before = meter.read() if meter else None
    await sink.run(stop)
    if meter:
        print(f"sink CPU per rollout (us): {meter.per(before, meter.read(), n, 1e6)}")
    await transport.close()
    assert sink.rows_written == n, (sink.rows_written, n)
    # Steady state: first record polled to last part stored (the group join before it is not throughput).
    return n / (sink.last_flush_at - sink.first_record_at)


def put_rate(store, run_id: str, n: int, inflight: int, meter: CpuMeter | None = None) -> float:
    """Rollouts/s of putting the table's data files' bytes to the same S3 server with plain boto3
    (``inflight`` at once, as the sink writes): the physical limit of the sink on this machine."""
    from storage.lake import LakeReader

    blobs = [store.get(f.key) for f in LakeReader(store, run_id).files()]
    client, bucket = store._client, store.bucket
    before = meter.read() if meter else None
    t0 = time.perf_counter()
    with ThreadPoolExecutor(inflight) as pool:
        list(pool.map(lambda ib: client.put_object(Bucket=bucket, Key=store._key(f"put-baseline/{run_id}/{ib[0]}"), Body=ib[1]),
                      enumerate(blobs)))  # fmt: skip
    elapsed = time.perf_counter() - t0
    if meter:
        print(f"put CPU per rollout (us): {meter.per(before, meter.read(), n, 1e6)}")
    return n / elapsed


def replay_rates(store, run_id: str, rounds: int, prefetch: int = 4, meter: CpuMeter | None = None):
    from storage.lake import LakeReader

    reader = LakeReader(store, run_id, prefetch=prefetch)
    keys = reader.parts()
    client, bucket = store._client, store.bucket

    def ours() -> int:
        return sum(1 for _ in reader.iter())

    def tables() -> int:
        return sum(t.num_rows for t in reader.iter_tables())

    def raw() -> int:
        with ThreadPoolExecutor(prefetch) as pool:
            sizes = list(pool.map(lambda k: len(client.get_object(Bucket=bucket, Key=store._key(k))["Body"].read()), keys))
        assert sum(sizes) > 0
        return n

    n = ours()  # warm: connections, page cache
    rates: dict[str, list[float]] = {"iter": [], "iter_tables": [], "raw": []}
    cpu: dict[str, str] = {}
    for _ in range(rounds):
        for name, fn in (("iter", ours), ("iter_tables", tables), ("raw", raw)):
            before = meter.read() if meter else None
            t0 = time.perf_counter()
            assert fn() == n
            rates[name].append(n / (time.perf_counter() - t0))
            if meter:
                cpu[name] = meter.per(before, meter.read(), len(keys))
    return rates, cpu, len(keys)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--demo-rate",
        type=float,
        default=1000.0,
        help="rollouts/s of `conveyor demo` (its display; 909-1,109 over three seeds)",
    )
    ap.add_argument("--sink-inflight", type=int, default=2, help="flushes the sink runs at once (StorageSink.max_inflight)")
    ap.add_argument("--compression", default=None, help="Parquet codec of the data files (default: storage.columns.COMPRESSION)")
    args = ap.parse_args()
    if args.compression:
        import storage.columns

        storage.columns.COMPRESSION = args.compression

    from conveyor.config import KafkaTransportConfig, S3StoreConfig
    from conveyor.objectstore import S3ObjectStore
    from launch.stack.components import LOCAL_S3_ACCESS_KEY, LOCAL_S3_SECRET_KEY
    from launch.stack.manager import Stack, StackPorts, free_port_block

    with tempfile.TemporaryDirectory() as tmp:
        stack = Stack(tmp, StackPorts.from_base(free_port_block()))
        stack.up(["kafka", "s3"], timeout_s=90)
        try:
            ep = stack.endpoints()
            kafka_cfg = KafkaTransportConfig(bootstrap_servers=ep["kafka"], partitions=4)
            store = S3ObjectStore(S3StoreConfig(endpoint_url=ep["s3"], bucket="bench", access_key_id=LOCAL_S3_ACCESS_KEY,
                                                secret_access_key=LOCAL_S3_SECRET_KEY))  # fmt: skip
            run_id = f"bench-{uuid.uuid4().hex[:6]}"
            rows = make_rows(run_id, args.n, args.tokens)
            size = sum(len(r.rollout.completion_token_ids) for r in rows) * 9 / len(rows)
            print(f"{args.n} rollouts of {args.tokens} tokens (~{size / 1024:.0f} KiB of arrays each)")
            asyncio.run(publish_rows(kafka_cfg, run_id, rows))
            del rows  # the sink service holds only what it consumed
            running = stack.read_state()
            meter = CpuMeter({"kafka": running["kafka"].pid, "s3": running["s3"].pid})
            rate = asyncio.run(sink_rate(kafka_cfg, store, run_id, args.n, args.sink_inflight, meter))
            print(f"sink: {rate:.0f} rollouts/s")
            put = put_rate(store, run_id, args.n, args.sink_inflight, meter)
            print(f"raw boto3 put of the same files: {put:.0f} rollouts/s")
            rates, cpu, parts = replay_rates(store, run_id, args.rounds, meter=meter)
            for o, t, r in zip(rates["iter"], rates["iter_tables"], rates["raw"]):
                print(
                    f"replay round: LakeReader.iter {o:.0f} rollouts/s, .iter_tables {t:.0f} rollouts/s, raw boto3 GET {r:.0f} rollouts/s"
                )
            for name, line in cpu.items():
                print(f"replay CPU per part ({parts} parts, last round, ms) {name}: {line}")
            o, t, r = (statistics.median(rates[k]) for k in ("iter", "iter_tables", "raw"))
            print(f"FIGURE sink_rollouts_per_s {rate:.0f} per_s")
            print(f"FIGURE sink_vs_demo_ratio {rate / args.demo_rate:.2f} x")
            print(f"FIGURE sink_vs_put_ratio {rate / put:.2f} x")
            print(f"FIGURE replay_rollouts_per_s {o:.0f} per_s")
            print(f"FIGURE replay_vs_raw_ratio {o / r:.2f} x")
            print(f"FIGURE replay_tables_vs_raw_ratio {t / r:.2f} x")
        finally:
            stack.down(grace_s=3)


if __name__ == "__main__":
    main()
