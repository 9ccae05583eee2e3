"""Rollout engines on one model, in one run: vLLM (continuous batching) against
the reference engine, n-gram speculative decoding against plain vLLM, and the
latency of an in-flight weight swap.

1. Sampling throughput (completion tokens/s): the same requests (``--prompts``
   prompts, ``n = --n`` samples each, ``--max-tokens`` tokens, temperature 1,
   no stop token) submitted all at once to the reference engine (batched,
   through :class:`rollout_workers.engine.BatchingEngine`) and to vLLM.
2. Speculative decoding: greedy decoding of repetitive prompts by vLLM with
   and without an n-gram proposer (outputs must be identical).
3. Weight swap: pause (requests kept), reload, KV reset, resume, with the
   throughput requests in flight.

    python bench/engines.py [--prompts 64] [--n 8] [--max-tokens 64] [--hidden 256] [--layers 4]

Ends with ``FIGURE vllm_vs_reference_throughput <v> x``,
``FIGURE ngram_spec_speedup <v> x`` and ``FIGURE vllm_swap_latency_ms <v> ms``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import asyncio
import tempfile
import time

ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789 ()+-*=:,.\n"


def vllm_engine(path, **kw):
    from rollout_workers.vllm_engine import VLLMEngine

    return VLLMEngine(path, dtype="float32", max_model_len=256, kv_cache_memory_bytes=1 << 30,
                      gpu_memory_utilization=0.1, seed=0, **kw)  # fmt: skip


async def throughput(engine, prompts, n, max_tokens, swap_weights=None) -> tuple[float, float | None]:
    from rollout_workers.engine import SamplingRequest

    reqs = [SamplingRequest(p, n=n, max_tokens=max_tokens, temperature=1.0) for p in prompts]
    t0 = time.perf_counter()
    running = [asyncio.create_task(engine.generate(r)) for r in reqs]
    swap_s = None
    if swap_weights is not None:
        await asyncio.sleep(0.5)
        s0 = time.perf_counter()
        await engine.swap(swap_weights, engine.version + 1)
        swap_s = time.perf_counter() - s0
    results = await asyncio.gather(*running)
    elapsed = time.perf_counter() - t0
    tokens = sum(len(c.token_ids) for g in results for c in g)
    return tokens / elapsed, swap_s


async def greedy_time(engine, prompts, max_tokens) -> tuple[float, list]:
    from rollout_workers.engine import SamplingRequest

    t0 = time.perf_counter()
    out = await asyncio.gather(*(engine.generate(SamplingRequest(p, n=1, max_tokens=max_tokens, greedy=True)) for p in prompts))
    return time.perf_counter() - t0, [g[0].token_ids for g in out]


async def main(args) -> None:
    import torch
    from safetensors.torch import save

    from learner.models import create_tiny_llama
    from rollout_workers.engine import BatchingEngine
    from rollout_workers.reference_engine import ReferenceEngine

    torch.set_num_threads(2)
    root = Path(tempfile.mkdtemp(prefix="bench-engines-"))
    model, tok = create_tiny_llama(root / "m", ALPHABET, seed=0, hidden_size=args.hidden, layers=args.layers,
                                   heads=args.hidden // 32, intermediate_size=args.hidden * 4 // 1, max_positions=256)  # fmt: skip
    texts = ["def f(x):", "total = 0", "for i in range(10):", "print(a, b)", "x = (1 + 2) * 3", "s = 'abc'"]
    prompts = [tok(texts[i % len(texts)] + f" {i}", add_special_tokens=False).input_ids for i in range(args.prompts)]
    state = {k: v.clone() + 0.01 for k, v in model.state_dict().items() if k != "lm_head.weight"}
    weights = save(state)

    ref = BatchingEngine(ReferenceEngine(root / "m", seed=0), max_batch_rows=args.prompts * args.n)
    ref_tps, _ = await throughput(ref, prompts, args.n, args.max_tokens)
    await ref.close()
    print(f"reference engine: {ref_tps:,.0f} completion tokens/s", flush=True)

    plain = vllm_engine(root / "m", enforce_eager=args.eager)
    await plain.start()
    await throughput(plain, prompts[:4], args.n, 8)  # warm-up
    vllm_tps, _ = await throughput(plain, prompts, args.n, args.max_tokens)
    print(f"vLLM: {vllm_tps:,.0f} completion tokens/s", flush=True)
    _, swap_s = await throughput(plain, prompts, args.n, args.max_tokens, swap_weights=weights)
    print(f"swap with {args.prompts * args.n} sequences in flight: {swap_s * 1000:.0f} ms", flush=True)
    await plain.swap(save({k: v.clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}), plain.version + 1)
    rep = [tok(("ab cd " * 8)[: 8 + i % 5], add_special_tokens=False).input_ids for i in range(16)]
    await greedy_time(plain, rep[:2], 8)
    plain_s, plain_out = await greedy_time(plain, rep, 128)
    await plain.close()

    spec = vllm_engine(root / "m", enforce_eager=args.eager,
                       speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2})  # fmt: skip
    await spec.start()
    await greedy_time(spec, rep[:2], 8)
    spec_s, spec_out = await greedy_time(spec, rep, 128)
    await spec.close()
    print(f"greedy, repetitive prompts: plain {plain_s:.2f} s, n-gram speculation {spec_s:.2f} s, "
          f"identical outputs: {spec_out == plain_out}", flush=True)  # fmt: skip
    print(f"FIGURE vllm_vs_reference_throughput {vllm_tps / ref_tps:.2f} x")
    print(f"FIGURE ngram_spec_speedup {plain_s / spec_s:.2f} x")
    print(f"FIGURE vllm_swap_latency_ms {swap_s * 1000:.0f} ms")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--eager", action="store_true", help="vLLM without graph compilation")
    asyncio.run(main(parser.parse_args()))
