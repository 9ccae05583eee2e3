"""What tracing every task costs the pipeline: throughput with tracing at 100 % sampling vs off.

The whole pipeline in one process (producer, rollout worker on the reference engine, reward bridge
with the bubblewrap sandbox, learner, storage sink) on in-memory topics and a local object store:
no broker or network to wait on, so the spans' cost is as large a share of the run as it gets.
Runs alternate, off / on / off / on ... (``--pairs``), each ``--seconds`` long after a short warm-up,
each with a fresh pipeline; throughput is rollouts stored in the lake per second. With tracing on,
every task is sampled and its spans go through the SDK's batch processor and OTLP/HTTP exporter
(protobuf) to a collector stand-in in another process that reads each request and answers 200:
the work a traced service does, without the collector's own.

    python3 bench/tracing.py [--seconds 40] [--pairs 2]

Ends with ``FIGURE tracing_overhead <on / off> x`` (goal >= 0.95) and ``FIGURE
tracing_cpu_per_rollout_ratio <on / off> x``: this process's CPU time per rollout stored, a
steadier measure of the same cost than throughput on a shared machine.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])  # the repository root, not bench/

GROUP = 4


def pipeline(transport, store, topics, work: Path, tasks, sandbox) -> dict:
    """The five services of a run, in this process (``tasks``: the producer's stream)."""
    from conveyor.config import LearnerConfig, SinkConfig
    from learner.models import create_tiny_llama
    from learner.recipe import GRPOLearner
    from producers.producer import TaskProducer
    from reward.bridge import RewardBridge
    from reward.scorers import LocalScorer
    from rollout_workers.reference_engine import ReferenceEngine
    from rollout_workers.worker import RolloutWorker
    from storage.sink import StorageSink
    from tasks.suites.pyexpr import ALPHABET

    model, tok = create_tiny_llama(work / "m", ALPHABET, seed=0, hidden_size=32, layers=2, heads=2, intermediate_size=64)
    engine = ReferenceEngine(work / "m", seed=0)
    return {
        "producer": TaskProducer(transport, topics, tasks, learner_batch_samples=2 * GROUP),
        "rollout-worker": RolloutWorker(
            transport, topics, engine, store, learner_batch_samples=2 * GROUP, max_lag=8, tasks_per_batch=4
        ),  # fmt: skip
        "reward-bridge": RewardBridge(transport, topics, LocalScorer(sandbox), engine.decode),
        "learner": GRPOLearner(
            transport,
            topics,
            model,
            tok.pad_token_id,
            store,
            LearnerConfig(batch_groups=2, max_lag=8, lr=1e-4, checkpoint_every=0),
            run_dir=work,
        ),  # fmt: skip
        "storage-sink": StorageSink(transport, topics, store, SinkConfig(flush_rows=16, flush_s=0.5)),
    }


def task_stream(run_id: str, seed: int = 3):
    from tasks.suites.pyexpr import sample_problems, to_task

    problems = sample_problems(random.Random(seed))
    i = 0
    while True:
        yield to_task(next(problems), run_id, GROUP, i)
        i += 1


COLLECTOR = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


async def one_run(seconds: float, warmup_s: float, traced: bool, sandbox, collector_port: int) -> tuple[float, float]:
    """Rollouts stored per second over ``seconds``, after ``warmup_s``, and this process's CPU
    time per rollout stored (every thread: the tracer's export thread too; not the sandbox's)."""
    from conveyor.objectstore import LocalObjectStore
    from conveyor.observability_config import TracingConfig
    from conveyor.topics import Topics
    from conveyor.tracing import configure_tracing, reset_tracing
    from conveyor.transport.memory import MemoryTransport

    if traced:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=f"http://127.0.0.1:{collector_port}/v1/traces")
        configure_tracing(TracingConfig(sample_ratio=1.0), "bench", "bench", exporter, batch=True)
    with tempfile.TemporaryDirectory(prefix="bench-tracing-") as tmp:
        work = Path(tmp)
        topics = Topics(f"tr-{'on' if traced else 'off'}")
        transport = MemoryTransport(partitions=2)
        await transport.create_topics(topics.specs(2))
        services = pipeline(transport, LocalObjectStore(work / "objects"), topics, work, task_stream(topics.run_id), sandbox)
        stop = asyncio.Event()
        runs = [asyncio.create_task(s.run(stop)) for s in services.values()]
        await asyncio.sleep(warmup_s)
        stored, started, cpu = services["storage-sink"].rows_written, time.monotonic(), time.process_time()
        await asyncio.sleep(seconds)
        done = services["storage-sink"].rows_written - stored
        rate, cpu_per = done / (time.monotonic() - started), (time.process_time() - cpu) / max(done, 1)
        stop.set()
        await asyncio.gather(*runs, return_exceptions=True)
    if traced:
        reset_tracing()  # flushes the batch processor
    return rate, cpu_per


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=40.0)
    parser.add_argument("--warmup", type=float, default=10.0)
    parser.add_argument("--pairs", type=int, default=2)
    args = parser.parse_args()
    from launch.stack.manager import free_port_block
    from sandbox.runner import Sandbox, SandboxLimits

    sandbox = Sandbox(SandboxLimits(), parallel=2)
    port = free_port_block(1)
    collector = subprocess.Popen([sys.executable, "-c", COLLECTOR, str(port)])
    rates: dict[bool, list[float]] = {False: [], True: []}
    cpu: dict[bool, list[float]] = {False: [], True: []}
    try:
        for i in range(args.pairs):
            for traced in (False, True):
                rate, cpu_per = asyncio.run(one_run(args.seconds, args.warmup, traced, sandbox, port))
                rates[traced].append(rate)
                cpu[traced].append(cpu_per)
                print(f"pair {i}: tracing {'on ' if traced else 'off'} {rate:.1f} rollouts/s, "
                      f"{cpu_per * 1e3:.3f} ms CPU per rollout", flush=True)  # fmt: skip
    finally:
        sandbox.close()
        collector.kill()
    off, on = (sum(rates[k]) / len(rates[k]) for k in (False, True))
    print(f"FIGURE tracing_off_rollouts_per_s {off:.1f} rollouts/s")
    print(f"FIGURE tracing_on_rollouts_per_s {on:.1f} rollouts/s")
    print(f"FIGURE tracing_overhead {on / off:.3f} x")
    per_pair = [b / a for a, b in zip(rates[False], rates[True])]
    print(f"tracing_overhead per pair: {', '.join(f'{r:.3f}' for r in per_pair)}")
    cpu_off, cpu_on = (sum(cpu[k]) / len(cpu[k]) for k in (False, True))
    print(f"FIGURE tracing_cpu_per_rollout_ratio {cpu_on / cpu_off:.3f} x")


if __name__ == "__main__":
    main()
