"""The learner's packed path with a GRPO group's prompt laid down once (a tree) against every
sequence whole, in one run: forward + backward of the packed completion log-probs.

A Llama-shaped model (``--hidden``, ``--layers``; random weights, vocabulary 256), a batch
of ``--groups`` prompts of ``--prompt`` tokens with ``--samples`` completions of
``--completion`` tokens each, packed into ``--pack-tokens``-token packs; PyTorch SDPA with
the pack's boolean mask (the CPU path; flash-attn's varlen kernel cannot take the tree and
keeps whole sequences). Each variant is timed ``--repeats`` times, alternating, and the
medians are compared; the log-probs and gradients of the two are checked equal first.

    python bench/packed_prompts.py [--prompt 256] [--completion 64] [--samples 8] [--groups 4]

Ends with ``FIGURE packed_shared_prompt_speedup <v> x`` (whole sequences' time / shared).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])  # the repository root, not bench/

import argparse
import statistics
import time


def main() -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import learner.packing as packing

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--completion", type=int, default=64)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--pack-tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
                      num_attention_heads=max(1, args.hidden // 64), max_position_embeddings=args.prompt + args.completion + 1,
                      tie_word_embeddings=True)  # fmt: skip
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(1)
    prompts, completions = [], []
    for _ in range(args.groups):
        p = torch.randint(0, 256, (args.prompt,), generator=g).tolist()
        for _ in range(args.samples):
            prompts.append(p)
            completions.append(torch.randint(0, 256, (args.completion,), generator=g).tolist())
    weights = torch.randn(len(prompts) * args.completion, generator=g)

    def run(share: bool):
        model.zero_grad()
        t = time.perf_counter()
        lp = packing.packed_completion_logprobs(model, prompts, completions, pack_tokens=args.pack_tokens, share_prompts=share)
        (torch.cat(lp) * weights).sum().backward()
        return time.perf_counter() - t, torch.cat(lp).detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    _, lw, gw = run(False)
    _, ls, gs = run(True)
    assert torch.allclose(lw, ls, atol=1e-4), float((lw - ls).abs().max())
    worst = max(float((gw[n] - gs[n]).abs().max() / (gw[n].abs().max() + 1e-12)) for n in gw)
    assert worst < 1e-3, worst
    tokens = {
        s: sum(p.tokens for p in packing.pack_sequences(prompts, completions, args.pack_tokens, share_prompts=s))
        for s in (False, True)
    }
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.repeats):
        for share in (False, True):
            times[share].append(run(share)[0])
    whole, shared = statistics.median(times[False]), statistics.median(times[True])
    print(
        f"{args.groups} groups x {args.samples} samples, prompt {args.prompt}, completion {args.completion}, packs of {args.pack_tokens}"
    )
    print(f"whole sequences: {tokens[False]} tokens, {whole * 1e3:.0f} ms fwd+bwd (median of {args.repeats})")
    print(
        f"shared prompts:  {tokens[True]} tokens, {shared * 1e3:.0f} ms fwd+bwd; same log-probs, gradients to {worst:.1e} relative"
    )
    print(f"FIGURE packed_shared_prompt_speedup {whole / shared:.2f} x")


if __name__ == "__main__":
    main()
