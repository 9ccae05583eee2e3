"""``learner.checkpoint_layout: sharded``: two FSDP2 ranks (torchrun, gloo) each write their own
shards, and no object holds the whole model; the checkpoint resumes on three ranks and on one
process to exactly the state the two ranks had (model and AdamW moments, bit for bit)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, free_port_block

pytestmark = pytest.mark.integration

SCRIPT = ROOT / "tests" / "integration" / "sharded_checkpoint_ranks.py"


def _run(mode: str, nproc: int, model_dir, store_dir, out) -> None:
    cmd = [sys.executable, str(SCRIPT), mode, str(model_dir), str(store_dir), str(out)]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
               f"--master-port={free_port_block()}", *cmd[1:]]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]


def test_each_rank_writes_its_shards_and_they_resume_on_three_ranks_and_on_one(tmp_path):
    from safetensors.torch import load, load_file

    from learner.models import create_tiny_llama
    from tasks.suites.pyexpr import ALPHABET

    create_tiny_llama(tmp_path / "m", ALPHABET, seed=0, heads=3)  # the demo's model
    store = tmp_path / "objects"
    _run("save", 2, tmp_path / "m", store, tmp_path / "two.safetensors")
    saved = load_file(tmp_path / "two.safetensors")

    ckpt = store / "runs" / "sharded" / "checkpoints"
    shards = sorted(p.name for p in ckpt.glob("step-000000003.rank-*.safetensors"))
    assert shards == ["step-000000003.rank-00000.safetensors", "step-000000003.rank-00001.safetensors"]
    main = load((ckpt / "step-000000003.safetensors").read_bytes())
    assert all(t.dim() == 0 for k, t in main.items() if k.startswith(("model", "optimizer"))), sorted(main)[:5]
    whole = sum(t.numel() for k, t in saved.items() if not k.endswith("/step"))  # AdamW's step counts stay in the manifest
    held = [sum(t.numel() for t in load((ckpt / name).read_bytes()).values()) for name in shards]
    assert all(h < 0.6 * whole for h in held) and sum(held) == whole  # halves, not the whole on one rank
    manifest = json.loads((ckpt / "step-000000003.json").read_text())
    assert '"layout": "sharded"' in json.dumps(manifest["state"])

    for nproc in (3, 1):
        _run("load", nproc, tmp_path / "m", store, tmp_path / f"on{nproc}.safetensors")
        resumed = load_file(tmp_path / f"on{nproc}.safetensors")
        assert resumed.keys() == saved.keys()
        for key, want in saved.items():
            assert torch.equal(resumed[key], want), (nproc, key)
    start = load((tmp_path / "m" / "model.safetensors").read_bytes())
    assert any(not torch.equal(saved[f"model/{k}"], v) for k, v in start.items())  # it trained: a resume is not a fresh start
