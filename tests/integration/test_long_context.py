"""Long context on CPU: a tiny model trains on one packed sequence of 4k, 8k
and 16k tokens (activation checkpointing, causal SDPA, chunked log-probs).
Peak memory must grow about linearly with length, not quadratically."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

STEP = r"""
import json, sys, tempfile, torch
from learner.models import create_tiny_llama
from learner.packing import packed_completion_logprobs
from tasks.suites.pyexpr import ALPHABET
torch.set_num_threads(2)
n = int(sys.argv[1])
model, tok = create_tiny_llama(tempfile.mkdtemp(), ALPHABET, seed=0, hidden_size=64, layers=2, heads=4,
                               intermediate_size=128, max_positions=16640)
model.config._attn_implementation = "sdpa"
model.gradient_checkpointing_enable()
model.train()
def step(length):
    prompt, completion = [3] * 16, [4 + i % 20 for i in range(length - 16)]
    lp = packed_completion_logprobs(model, [prompt], [completion], pack_tokens=length, chunk_tokens=1024)
    (-lp[0].mean()).backward()
    model.zero_grad(set_to_none=True)
def status_kib(field):
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith(field + ":"))
step(256)  # load kernels, allocate the optimizer-free baseline
with open("/proc/self/clear_refs", "w") as fh:  # reset the peak (VmHWM) to the current RSS: earlier
    fh.write("5")                                 # peaks (model creation) would hide the step's own
base = status_kib("VmRSS")
step(n)
print(json.dumps({"tokens": n, "step_kib": status_kib("VmHWM") - base}))
"""


def peak_kib(n: int) -> int:
    out = subprocess.run([sys.executable, "-c", STEP, str(n)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])["step_kib"]


@pytest.mark.timeout(900)
def test_peak_memory_grows_linearly_up_to_16k_tokens():
    mem = {n: peak_kib(n) for n in (4096, 8192, 16384)}
    print("peak memory above baseline (MiB):", {n: round(v / 1024, 1) for n, v in mem.items()})
    # Linear growth: 4x the 4k peak at 16k; quadratic attention memory: 16x (and one head's
    # 16k x 16k fp32 scores alone would be 1 GiB). Peak RSS carries allocator noise of tens of
    # MiB, so the bounds compare peaks, not differences of peaks (3.5 between increments was seen).
    assert mem[16384] < 6.0 * max(mem[4096], 1), mem
    assert mem[16384] < 3.0 * max(mem[8192], 1), mem
    assert mem[16384] < 512 * 1024, mem
