"""FSDP2 under torchrun: 2 CPU processes (gloo) give the same GRPO loss and
gradients as 1 process, within tolerance."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, free_port_block

SCRIPT = Path(__file__).with_name("fsdp_step.py")  # run by torchrun, not collected (no test_ prefix)


def run(nproc: int, out: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--master-port={free_port_block()}",
           str(SCRIPT), str(out)]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert res.returncode == 0 and out.exists(), res.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.timeout(900)
def test_two_gloo_processes_match_one(tmp_path):
    one = run(1, tmp_path / "one.json")
    two = run(2, tmp_path / "two.json")
    assert two["world"] == 2
    assert two["loss"] == pytest.approx(one["loss"], abs=1e-5)
    assert one["grads"].keys() == two["grads"].keys()
    worst = max(float((torch.tensor(one["grads"][k]) - torch.tensor(two["grads"][k])).abs().max()) for k in one["grads"])
    assert worst < 1e-5, worst
