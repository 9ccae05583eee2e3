"""Learner throughput on one GPU: tokens/s, model FLOPs utilisation, peak memory.

A randomly initialised model of about 0.5B parameters in the Llama/Qwen2
shape (hidden 896, 24 layers, 14 heads / 2 KV heads, MLP 4864, vocabulary
151,936, tied embeddings), bf16 parameters, trained with the learner's own
path: packed 4,096-token sequences (``learner/packing.py``: no padding,
position ids restarting per sequence, chunked and checkpointed log-probs so
the full-vocabulary logits are never materialised for all tokens at once),
the GRPO loss (``learner/grpo.py``), activation checkpointing, fused AdamW.

MFU = achieved model FLOPs / peak, where model FLOPs per token =
6·N (dense matmuls, forward + backward) + 12·layers·hidden·seq (attention
scores and values), N counting the LM head, and the peak is *measured* on
this card with a large bf16 matmul (not the datasheet).

    python bench/learner_gpu.py                   # on a GPU: ~2-4 minutes
    python bench/learner_gpu.py --smoke           # a tiny shape on CPU: checks the script runs

Ends with ``FIGURE learner_mfu <v> fraction``, ``FIGURE learner_tokens_per_s <v> tokens/s``
and ``FIGURE learner_peak_gib <v> GiB``; with 2 or more GPUs, the context-parallel case
(``bench/context_parallel.py`` at 32k tokens: peak memory per GPU with the pack split over them).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])  # the repository root, not bench/


def matmul_peak_flops(device, dtype, n: int = 8192, iters: int = 50) -> float:
    import torch

    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(5):
        a @ b
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        a @ b
    torch.cuda.synchronize()
    return 2 * n**3 * iters / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shape on CPU (a correctness check of the script)")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--packs", type=int, default=8, help="4k-token packs per optimizer step")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=2048, help="tokens per log-prob chunk")
    ap.add_argument("--no-checkpointing", action="store_true")
    ap.add_argument("--attn", default="sdpa", choices=["sdpa", "flash_attention_2", "flex_attention"],
                    help="the learner's attention kernel (flex_attention and flash_attention_2: GPU only)")  # fmt: skip
    args = ap.parse_args()

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from learner.grpo import LossConfig, clipped_pg_loss
    from learner.packing import packed_completion_logprobs

    if args.smoke:
        device, dtype = torch.device("cpu"), torch.float32
        cfg = LlamaConfig(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True)  # fmt: skip
        args.seq, args.packs, args.steps, args.warmup, args.chunk = 512, 2, 2, 1, 256
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no GPU: run with --smoke for the CPU check")
        device, dtype = torch.device("cuda"), torch.bfloat16
        cfg = LlamaConfig(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                          num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1e6, tie_word_embeddings=True,
                          rms_norm_eps=1e-6)  # fmt: skip
        torch.backends.cuda.matmul.allow_tf32 = True
    cfg._attn_implementation = "sdpa" if args.smoke else args.attn  # no FlexAttention backward on CPU
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(device=device, dtype=dtype)
    if not args.no_checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
    loss_cfg = LossConfig()
    # Each pack: 8 sequences of seq/8 tokens (a 128-token prompt and the rest completion).
    per = args.seq // 8
    plen = min(128, per // 4)
    g = torch.Generator().manual_seed(0)

    def batch():
        prompts = [torch.randint(0, cfg.vocab_size, (plen,), generator=g).tolist() for _ in range(8 * args.packs)]
        comps = [torch.randint(0, cfg.vocab_size, (per - plen,), generator=g).tolist() for _ in range(8 * args.packs)]
        behaviour = [torch.full((per - plen,), -2.0, device=device) for _ in comps]
        masks = [torch.ones(per - plen, device=device) for _ in comps]
        adv = [float(x) for x in torch.randn(len(comps), generator=g)]
        return prompts, comps, behaviour, masks, adv

    def step():
        prompts, comps, behaviour, masks, adv = batch()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            new = packed_completion_logprobs(model, prompts, comps, pack_tokens=args.seq, chunk_tokens=args.chunk)
        new = [x.float() for x in new]
        loss, _ = clipped_pg_loss(new, behaviour, adv, masks, loss_cfg)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return float(loss)

    for _ in range(args.warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    tokens = args.steps * args.packs * args.seq
    tps = tokens / elapsed
    flops_per_token = 6 * n_params + 12 * cfg.num_hidden_layers * cfg.hidden_size * args.seq
    print(f"params {n_params / 1e6:.1f}M, {tokens} tokens in {elapsed:.1f}s")
    print(f"FIGURE learner_tokens_per_s {tps:.0f} tokens/s")
    if device.type == "cuda":
        peak = matmul_peak_flops(device, torch.bfloat16)
        mfu = tps * flops_per_token / peak
        print(f"measured bf16 matmul peak {peak / 1e12:.0f} TFLOP/s")
        print(f"FIGURE learner_mfu {mfu:.3f} fraction")
        print(f"FIGURE learner_peak_gib {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    else:
        print("FIGURE learner_mfu pending fraction  (CPU smoke run: no GPU figure)")
    context_parallel_case(torch.cuda.device_count() if device.type == "cuda" else 0)


def context_parallel_case(gpus: int) -> None:
    """With several GPUs: peak memory per GPU for 32k-token packs of the same shape split over up
    to 4 of them (bench/context_parallel.py under torchrun, NCCL, ring attention)."""
    import subprocess

    if gpus < 2:
        print("FIGURE cp_gpu_memory_per_rank_ratio pending  (context parallelism needs 2 or more GPUs)")
        return
    ranks = [str(n) for n in (1, 2, 4) if n <= gpus]
    script = Path(__file__).with_name("context_parallel.py")
    subprocess.run([sys.executable, str(script), "--tokens", "32768", "--ranks", *ranks, "--hidden", "896", "--layers", "24",
                    "--heads", "14", "--intermediate", "4864"], check=True)  # fmt: skip


if __name__ == "__main__":
    main()
