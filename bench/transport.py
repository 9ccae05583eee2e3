"""Transport overhead: 16 KB trajectories through Conveyor vs raw aiokafka.

Both sides run in one process against the same broker, in alternating
rounds, with the same producer settings (acks=all, linger, batch size) and
the same consumer settings (a fresh consumer group, manual commit after each
batch). Conveyor's side encodes a ``Rollout`` struct per message and decodes
it back (type checked, dead-letter path armed); the raw side sends the
already-encoded bytes and never decodes. The ratio is Conveyor/raw
throughput over produce + consume.

    python bench/transport.py                    # starts a broker from the local stack
    python bench/transport.py --bootstrap H:P    # an existing broker

Ends with ``FIGURE transport_ratio <v> x`` (and the two rates).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
import uuid


def make_rollouts(n: int, tokens: int):
    from conveyor.contracts import Rollout, Task, VersionSegment, float32_array, int32_array, rollout_id, uint8_array

    task = Task(task_id="bench", run_id="bench", prompt="x" * 64)
    ids = int32_array(range(tokens))
    lps = float32_array([-0.25] * tokens)
    mask = uint8_array([1] * tokens)
    return [
        Rollout(
            rollout_id=rollout_id(f"task-{i // 8}", i % 8),
            task_id=f"task-{i // 8}",
            run_id="bench",
            sample_index=i % 8,
            group_size=8,
            prompt_token_ids=int32_array(range(16)),
            completion_token_ids=ids,
            behaviour_logprobs=lps,
            loss_mask=mask,
            version_segments=[VersionSegment(start=0, end=tokens, policy_version=0)],
            task=task,
        )
        for i in range(n)
    ]


async def wait_assigned(assignment, timeout_s: float = 60) -> None:
    """Group join happens in the background; time only the data path."""
    deadline = time.perf_counter() + timeout_s
    while not assignment():
        if time.perf_counter() > deadline:
            raise RuntimeError("consumer was never assigned partitions")
        await asyncio.sleep(0.05)


async def consume_until(getmany, commit, n: int, timeout_s: float = 300) -> int:
    got = 0
    deadline = time.perf_counter() + timeout_s
    while got < n and time.perf_counter() < deadline:
        batch = await getmany()
        got += batch
        if batch:
            await commit()
    if got < n:
        raise RuntimeError(f"consumed only {got}/{n}")
    return got


async def raw_round(cfg, payloads: list[bytes], keys: list[bytes], partitions: int) -> float:
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

    from conveyor.transport import TopicSpec
    from conveyor.transport.kafka import KafkaTransport

    topic = f"bench-raw-{uuid.uuid4().hex[:8]}"
    await KafkaTransport(cfg).create_topics([TopicSpec(topic, partitions)])
    producer = AIOKafkaProducer(
        bootstrap_servers=cfg.bootstrap_servers,
        acks="all",
        max_batch_size=cfg.max_batch_bytes,
        linger_ms=cfg.linger_ms,
        max_request_size=cfg.max_request_bytes,
    )
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=cfg.bootstrap_servers,
        group_id=f"g-{topic}",
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        fetch_max_bytes=52428800,
        max_partition_fetch_bytes=cfg.max_request_bytes,
    )
    await producer.start()
    await consumer.start()
    try:
        await wait_assigned(consumer.assignment)
        t0 = time.perf_counter()
        futures = [await producer.send(topic, value=v, key=k) for v, k in zip(payloads, keys)]
        await asyncio.gather(*futures)
        t1 = time.perf_counter()

        async def getmany():
            batches = await consumer.getmany(timeout_ms=500)
            return sum(len(rs) for rs in batches.values())

        await consume_until(getmany, consumer.commit, len(payloads))
        t2 = time.perf_counter()
        print(f"  raw      produce {t1 - t0:.3f}s consume {t2 - t1:.3f}s", flush=True)
        return len(payloads) / (t2 - t0)
    finally:
        await producer.stop()
        await consumer.stop()


async def conveyor_round(cfg, rollouts, partitions: int) -> float:
    from conveyor.contracts import Rollout
    from conveyor.messaging import DeadLetterSink, Publisher, Subscriber
    from conveyor.transport import TopicSpec
    from conveyor.transport.kafka import KafkaTransport

    transport = KafkaTransport(cfg)
    topic = f"bench-conveyor-{uuid.uuid4().hex[:8]}"
    await transport.create_topics([TopicSpec(topic, partitions), TopicSpec(topic + ".dl", 1)])
    producer = transport.producer()
    await producer.start()
    pub = Publisher(producer, topic)
    sub = Subscriber(transport, [topic], f"g-{topic}", Rollout, dead_letters=DeadLetterSink(producer, topic + ".dl", "bench"))
    await sub.start()
    try:
        await wait_assigned(sub.assignment)
        t0 = time.perf_counter()
        futures = [await pub.publish(r, r.task_id) for r in rollouts]
        await asyncio.gather(*futures)
        t1 = time.perf_counter()

        async def getmany():
            return len(await sub.poll(timeout_s=0.5))

        await consume_until(getmany, sub.commit, len(rollouts))
        t2 = time.perf_counter()
        print(f"  conveyor produce {t1 - t0:.3f}s consume {t2 - t1:.3f}s", flush=True)
        if sub.dead_lettered:
            raise RuntimeError(f"{sub.dead_lettered} records dead-lettered")
        return len(rollouts) / (t2 - t0)
    finally:
        await sub.close()
        await producer.close()


async def run(
    bootstrap: str, n: int, rounds: int, tokens: int, partitions: int, args_in_flight: int = 64 << 20
) -> tuple[float, float, int]:
    from conveyor.config import KafkaTransportConfig
    from conveyor.contracts import encode

    cfg = KafkaTransportConfig(bootstrap_servers=bootstrap, max_in_flight_bytes=args_in_flight)
    rollouts = make_rollouts(n, tokens)
    payloads = [encode(r) for r in rollouts]
    keys = [r.task_id.encode() for r in rollouts]
    size = len(payloads[0])
    raw_rates, conv_rates = [], []
    await raw_round(cfg, payloads[:200], keys[:200], partitions)  # warm-up: connections, metadata
    for i in range(rounds):
        # Alternate the order so drift on a shared machine hits both sides.
        if i % 2 == 0:
            raw_rates.append(await raw_round(cfg, payloads, keys, partitions))
            conv_rates.append(await conveyor_round(cfg, rollouts, partitions))
        else:
            conv_rates.append(await conveyor_round(cfg, rollouts, partitions))
            raw_rates.append(await raw_round(cfg, payloads, keys, partitions))
        print(f"round {i + 1}: raw {raw_rates[-1]:,.0f}/s  conveyor {conv_rates[-1]:,.0f}/s", flush=True)
    return statistics.median(raw_rates), statistics.median(conv_rates), size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bootstrap", help="host:port of an existing broker (default: start one)")
    parser.add_argument("--messages", type=int, default=6000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=1800, help="completion tokens per trajectory (1800 -> ~16 KB)")
    parser.add_argument("--partitions", type=int, default=4)
    args = parser.parse_args()

    stack = None
    bootstrap = args.bootstrap
    if bootstrap is None:
        from launch.stack.manager import Stack, StackPorts, free_port_block

        stack = Stack(tempfile.mkdtemp(prefix="conveyor-bench-"), StackPorts.from_base(free_port_block()))
        stack.up(["kafka"])
        bootstrap = stack.endpoints()["kafka"]
    try:
        raw, conv, size = asyncio.run(run(bootstrap, args.messages, args.rounds, args.tokens, args.partitions))
    finally:
        if stack is not None:
            stack.down(grace_s=3)
    print(f"message size {size} bytes, {args.messages} messages x {args.rounds} rounds, median rates")
    print(f"FIGURE transport_raw_rate {raw:.0f} msg/s")
    print(f"FIGURE transport_conveyor_rate {conv:.0f} msg/s")
    print(f"FIGURE transport_ratio {conv / raw:.3f} x")


if __name__ == "__main__":
    main()
