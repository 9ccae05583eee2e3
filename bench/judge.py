"""How fast the ``judge`` verifier grades against a local vLLM OpenAI-compatible server (a small
chat model made here, ``Score: <digit>`` held by constrained decoding), and what it costs over
the bare client.

    python3 bench/judge.py            # 96 samples at concurrency 8, 32 at concurrency 1

- ``judge_throughput``: samples/s through ``score_batch`` with ``max_concurrency`` 8, every
  sample distinct (no cache hit).
- ``judge_vs_client_ratio``: that rate / the ``openai`` client's own rate on the same requests
  at the same concurrency, run first (the baseline: the server's speed).
- ``judge_concurrency_speedup``: concurrency 8 / concurrency 1 (other samples, same server).
- ``judge_cache_hit_rate``: samples/s when every sample was graded before (no request).

Figures are ratios measured in one run; the absolute rates are the server's, on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

HELD = {"structured_outputs": {"regex": "Score: [0-9]"}}


def _items(prefix: str, n: int):
    from conveyor.contracts import Task, VerifierSpec

    rubric = "Full marks for the right sum, none for a wrong one."
    return [(Task(task_id=f"{prefix}{i}", run_id="judge-bench", prompt=f"What is {i} + {i}?",
                  verifier=VerifierSpec(kind="judge", data={"rubric": rubric})), f"It is {2 * i + i % 3}.")
            for i in range(n)]  # fmt: skip


def _client_rate(cfg, items, concurrency: int) -> float:
    """The bare ``openai`` client: the same requests, ``concurrency`` in flight."""
    from openai import AsyncOpenAI

    from tasks.judge import messages_for

    async def go() -> float:
        client = AsyncOpenAI(base_url=cfg.url, api_key="EMPTY", max_retries=cfg.max_retries, timeout=cfg.timeout_s)
        gate = asyncio.Semaphore(concurrency)

        async def one(task, completion):
            async with gate:
                await client.chat.completions.create(model=cfg.model, messages=messages_for(task, completion, cfg),
                                                     temperature=0, max_tokens=cfg.max_tokens, extra_body=HELD)  # fmt: skip

        t0 = time.perf_counter()
        await asyncio.gather(*(one(t, c) for t, c in items))
        rate = len(items) / (time.perf_counter() - t0)
        await client.close()
        return rate

    return asyncio.run(go())


def _judge_rate(items) -> tuple[float, list]:
    from tasks.verifiers import score_batch

    t0 = time.perf_counter()
    out = score_batch(None, items)
    return len(items) / (time.perf_counter() - t0), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=96)
    ap.add_argument("--single-samples", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    args = ap.parse_args()

    from chat_models import create_tiny_qwen2_chat

    from conveyor.reward_config import JudgeConfig
    from launch.stack.manager import free_port_block
    from launch.stack.openai_server import OpenAIServer
    from tasks import judge

    with tempfile.TemporaryDirectory(prefix="judge-bench-") as tmp:
        model = create_tiny_qwen2_chat(Path(tmp) / "model", hidden_size=128, heads=4, max_positions=2048)
        server = OpenAIServer(model, free_port_block(1), Path(tmp) / "server.log").start()
        try:
            base = {"url": server.url, "model": "judge", "score_max": 9, "max_tokens": 8, "extra_body": HELD}
            cfg = JudgeConfig(**base, max_concurrency=args.concurrency)
            _client_rate(cfg, _items("w", 8), args.concurrency)  # warm: the server's first requests
            client = _client_rate(cfg, _items("c", args.samples), args.concurrency)
            judge.configure({"default": cfg})
            many, out = _judge_rate(_items("j", args.samples))
            bad = [v for v in out if v.verdict not in ("pass", "fail")]
            if bad:
                raise RuntimeError(f"{len(bad)} samples were not graded: {bad[0].feedback}")
            cached, _ = _judge_rate(_items("j", args.samples))
            judge.configure({"default": JudgeConfig(**base, max_concurrency=1)})
            single, _ = _judge_rate(_items("s", args.single_samples))
        finally:
            server.stop()
    print({"client_per_s": client, "judge_per_s": many, "judge_single_per_s": single, "cached_per_s": cached})
    print(f"FIGURE judge_throughput {many:.1f} per_s")
    print(f"FIGURE judge_vs_client_ratio {many / client:.2f} x")
    print(f"FIGURE judge_concurrency_speedup {many / single:.2f} x")
    print(f"FIGURE judge_cache_hit_rate {cached:.0f} per_s")


if __name__ == "__main__":
    main()
