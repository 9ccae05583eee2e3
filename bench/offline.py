"""Offline post-training from a demo run's lake: held-out pass rate of the
warmed-up model before and after rejection-sampling SFT and after DPO.

    conveyor demo --budget 40                       # makes runs/<run>/ and runs/objects
    python bench/offline.py runs/<run> [--heldout 200] [--rft-epochs 2] [--dpo-epochs 1]

Both recipes start from the run's warmed-up model (``runs/<run>/model``,
saved before RL) and read only the lake (``runs/objects``). The held-out
problems were never used for training (the demo family's split).
Ends with ``FIGURE offline_heldout_start``, ``FIGURE offline_rft_heldout`` and ``FIGURE offline_dpo_heldout``.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Import from the repository root, not bench/ (bench/storage.py would shadow the `storage` package).
sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--heldout", type=int, default=200)
    ap.add_argument("--rft-epochs", type=int, default=2)
    ap.add_argument("--dpo-epochs", type=int, default=1)
    ap.add_argument("--max-rows", type=int, default=20000, help="read at most this many lake rows")
    args = ap.parse_args()

    import itertools

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from conveyor.objectstore import LocalObjectStore
    from launch.demo import Evaluator
    from learner.offline import dpo_pairs, rejection_sampling_sft, train_dpo
    from rollout_workers.reference_engine import ReferenceEngine
    from sandbox.runner import Sandbox, SandboxLimits
    from storage.lake import LakeReader
    from tasks.suites.pyexpr import heldout_set, to_task

    run_dir = args.run_dir.resolve()
    run_id = json.loads((run_dir / "config.json").read_text())["run_id"]
    store = LocalObjectStore(run_dir.parent / "objects")
    rows = list(itertools.islice(LakeReader(store, run_id).iter(), args.max_rows))
    model_dir = run_dir / "model"
    tok = AutoTokenizer.from_pretrained(model_dir)
    sandbox = Sandbox(SandboxLimits(timeout_s=1.0))
    engine = ReferenceEngine(model_dir, seed=0)
    heldout = [to_task(p, run_id, 1, i, "heldout") for i, p in enumerate(heldout_set(args.heldout))]
    evaluator = Evaluator(engine, sandbox, heldout)
    torch.manual_seed(0)

    def evaluate(model) -> float:
        engine.load_state_dict(model.state_dict(), 1)
        return evaluator.pass_rate()

    def fresh():
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    start = evaluate(fresh())
    m = fresh()
    rft = rejection_sampling_sft(m, rows, tok.pad_token_id, epochs=args.rft_epochs)
    rft_rate = evaluate(m)
    m = fresh()
    dpo = train_dpo(m, dpo_pairs(rows), tok.pad_token_id, epochs=args.dpo_epochs)
    dpo_rate = evaluate(m)
    print(f"lake rows read: {len(rows)}; RFT: {rft}; DPO: {dpo}")
    print(f"FIGURE offline_heldout_start {start:.3f} fraction")
    print(f"FIGURE offline_rft_heldout {rft_rate:.3f} fraction")
    print(f"FIGURE offline_dpo_heldout {dpo_rate:.3f} fraction")
    sandbox.close()


if __name__ == "__main__":
    main()
