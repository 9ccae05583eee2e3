"""Peak activation memory per rank with context parallelism: does it fall as 1/N and grow linearly?

    python bench/context_parallel.py [--tokens 16384 32768 65536] [--ranks 1 2 4]
    python bench/learner_gpu.py                  # with 2+ GPUs: this at 32k tokens, the 0.5B shape

For every packed length T and group size N: one training pass (forward and backward of the packed
log-probabilities, activation checkpointing on) of a tiny Llama on one pack of T tokens holding
four documents (a prompt and its completion each), split across N ranks with ring attention
(``learner/context_parallel.py``). N = 1 is the same kernel on a group of one: every rank count
runs the same code. N > 1 runs under torchrun (gloo on CPU; NCCL on GPUs, where memory is
``torch.cuda.max_memory_allocated``).

Memory on CPU is each rank's peak resident set during the pass above its resident set before it
(``/proc/self/clear_refs`` resets the peak after a warm-up pass), with ``MALLOC_MMAP_THRESHOLD_``
fixed so that freed tensors go back to the system rather than staying in the heap. The figure is
the largest rank's peak at N = 4 over the peak at N = 1, at 32k tokens (``--tokens`` must include
32768 and ``--ranks`` 1 and 4 for it).

Ends with ``FIGURE cp_memory_per_rank_ratio`` and a table of MiB per rank.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Import from the repository root, not bench/ (bench/storage.py would shadow the `storage` package).
sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import json
import os
import subprocess
import tempfile

ROOT = Path(__file__).resolve().parents[1]


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith(field + ":"))


def worker(tokens: int, out: str, shape: dict) -> None:
    """One rank (or the one process of N = 1): its peak memory above baseline for one pass."""
    import torch

    from learner.build import use_ring_attention
    from learner.context_parallel import ContextGroup
    from learner.distributed import RankGroup
    from learner.models import create_tiny_llama
    from learner.packing import packed_completion_logprobs
    from tasks.suites.pyexpr import ALPHABET

    world = int(os.environ.get("WORLD_SIZE", "1"))
    ranks = RankGroup.from_env(world)
    context = ranks.context if ranks is not None else ContextGroup(None, 1, 0)
    cuda = torch.cuda.is_available()
    model, _ = create_tiny_llama(tempfile.mkdtemp(), ALPHABET, seed=0, max_positions=tokens, **shape)
    use_ring_attention(model)
    if cuda:
        model = model.cuda()
    model.gradient_checkpointing_enable()
    model.train()

    def step(length: int) -> None:
        doc = length // 4
        prompts = [[3 + d] * 16 for d in range(4)]
        completions = [[4 + (i + d) % 20 for i in range(doc - 16)] for d in range(4)]
        lp = packed_completion_logprobs(model, prompts, completions, pack_tokens=length, context=context)
        (-torch.cat(lp).mean()).backward()
        model.zero_grad(set_to_none=True)

    step(1024 * context.size)  # kernels loaded, buffers allocated
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # the peak (VmHWM) back to the current resident set
        base = _status_kib("VmRSS") * 1024
    step(tokens)
    peak = (torch.cuda.max_memory_allocated() if cuda else _status_kib("VmHWM") * 1024) - base
    peaks = ranks.gather(peak) if ranks is not None else [peak]
    if ranks is None or ranks.leader:
        Path(out).write_text(json.dumps({"tokens": tokens, "ranks": context.size, "peak_bytes": peaks}))
    if ranks is not None:
        ranks.close()


def measure(tokens: int, nproc: int, shape: list[str]) -> list[int]:
    out = Path(tempfile.mkdtemp()) / "peak.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "MALLOC_MMAP_THRESHOLD_": "65536"}
    me = [str(Path(__file__).resolve()), "--worker", str(tokens), str(out), *shape]
    if nproc == 1:
        cmd = [sys.executable, *me]
    else:
        port = 29500 + (os.getpid() % 1000) * 7 % 5000
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--master-port={port}", *me]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=3600)
    if res.returncode != 0:
        raise SystemExit(f"T={tokens} N={nproc} failed:\n{res.stderr[-3000:]}")
    return json.loads(out.read_text())["peak_bytes"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[16384, 32768, 65536])
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=128)
    ap.add_argument("--worker", nargs=2, metavar=("TOKENS", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    shape = {"hidden_size": args.hidden, "layers": args.layers, "heads": args.heads, "intermediate_size": args.intermediate}
    if args.worker:
        worker(int(args.worker[0]), args.worker[1], shape)
        return
    shape_args = [f"--{k}={v}" for k, v in vars(args).items() if k in ("hidden", "layers", "heads", "intermediate")]
    mib = {}
    for tokens in args.tokens:
        for n in args.ranks:
            peaks = measure(tokens, n, shape_args)
            mib[(tokens, n)] = max(peaks) / 2**20
            print(json.dumps({"tokens": tokens, "ranks": n, "peak_mib_per_rank": [round(p / 2**20, 1) for p in peaks]}),
                  flush=True)  # fmt: skip
    print("| tokens | " + " | ".join(f"N={n} MiB/rank" for n in args.ranks) + " |")
    print("|---|" + "---|" * len(args.ranks))
    for tokens in args.tokens:
        print(f"| {tokens} | " + " | ".join(f"{mib[(tokens, n)]:.0f}" for n in args.ranks) + " |")
    if (32768, 1) in mib and (32768, 4) in mib:
        ratio = mib[(32768, 4)] / mib[(32768, 1)]
        print(f"FIGURE cp_memory_per_rank_ratio {ratio:.3f} (peak per rank, N=4 over N=1, 32k tokens; goal <= 0.35)")


if __name__ == "__main__":
    main()
