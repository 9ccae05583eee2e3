"""The learner's GPU figures in one call, for a lent GPU machine (torch, transformers and, where it
builds, flash-attn; no vLLM): ``bench/learner_gpu.py`` once per attention kernel and pack length,
each in its own process (a fresh CUDA context, its own peak memory), within a time budget.

Cases, in order (the first is the figure of record): sdpa at 8 x 4,096 packed tokens, then
flex_attention and flash_attention_2 (when importable) at 4,096, then each kernel at 2 x 16,384
(the same tokens per step). A case that would start after ``--budget-s`` is listed as skipped; a
case that fails is listed with its last line, and the others still run.

    python bench/gpu.py                  # on one H100/H200: ~5-7 minutes
    python bench/gpu.py --smoke          # on CPU: the plumbing, with learner_gpu.py's tiny shape

On a machine with torch and transformers but not this project's other dependencies (the lent
GPU machines' image), ``bench/gpu_wheels.sh`` fetches the few wheels the learner's modules import
(pydantic, msgspec, ...) and prints the command that installs them there and runs this script.

Prints one table of tokens/s, MFU and peak GiB per case, then the figures of record:
``FIGURE learner_tokens_per_s``, ``learner_mfu``, ``learner_peak_gib`` (sdpa, 4k) and, per other
case, ``FIGURE learner_mfu_<attn>_<seq> <v> fraction``. LoRA cases: pending (no LoRA in the learner).
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import subprocess
import sys
import time
from pathlib import Path

SCRIPT = Path(__file__).with_name("learner_gpu.py")


def cases(smoke: bool) -> list[tuple[str, int, int]]:
    """(attention kernel, pack tokens, packs per step)."""
    if smoke:
        return [("sdpa", 512, 2)]  # no FlexAttention backward and no flash-attn on CPU
    kernels = ["sdpa", "flex_attention"] + (["flash_attention_2"] if importlib.util.find_spec("flash_attn") else [])
    return [(k, 4096, 8) for k in kernels] + [(k, 16384, 2) for k in kernels]


def run_case(attn: str, seq: int, packs: int, smoke: bool, timeout_s: float) -> dict:
    cmd = [sys.executable, str(SCRIPT), "--attn", attn, "--seq", str(seq), "--packs", str(packs)]
    if smoke:
        cmd.append("--smoke")
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"over {timeout_s:.0f} s"}
    figures = {m[1]: m[2] for m in re.finditer(r"^FIGURE (\S+) (\S+)", out.stdout, re.M)}
    if out.returncode != 0 or "learner_tokens_per_s" not in figures:
        last = (out.stderr or out.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"error": f"exit {out.returncode}: {last[0][:160]}"}
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU: run the tiny shape through the same plumbing")
    ap.add_argument("--budget-s", type=float, default=420.0, help="no case starts after this many seconds")
    ap.add_argument("--case-timeout-s", type=float, default=180.0)
    args = ap.parse_args()
    started, results = time.monotonic(), []
    for attn, seq, packs in cases(args.smoke):
        left = args.budget_s - (time.monotonic() - started)
        if left <= 0:
            results.append((attn, seq, {"error": "skipped: over the time budget"}))
            continue
        results.append((attn, seq, run_case(attn, seq, packs, args.smoke, min(args.case_timeout_s, left + 60))))
        print(f"{attn} at {seq}: {results[-1][2]}", flush=True)
    print("\n| attention | pack tokens | tokens/s | MFU | peak GiB |\n|---|---|---|---|---|")
    for attn, seq, r in results:
        cells = [r.get("learner_tokens_per_s", "—"), r.get("learner_mfu", "—"), r.get("learner_peak_gib", "—")]
        print(f"| {attn} | {seq} | " + " | ".join(cells) + " |" + (f" {r['error']}" if "error" in r else ""))
    record = results[0][2]
    for name, unit in (("learner_tokens_per_s", "tokens/s"), ("learner_mfu", "fraction"), ("learner_peak_gib", "GiB")):
        print(f"FIGURE {name} {record.get(name, 'pending')} {unit}")
    for attn, seq, r in results[1:]:
        print(f"FIGURE learner_mfu_{attn}_{seq} {r.get('learner_mfu', 'pending')} fraction")
    print("FIGURE learner_mfu_lora pending fraction  (the learner has no LoRA yet)")
    if "error" in record:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
