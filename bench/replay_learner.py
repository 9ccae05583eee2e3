"""Replay against the learner it feeds: can the lake keep an offline recipe busy?

    conveyor demo --budget 40                       # makes runs/<run> and runs/objects
    python bench/replay_learner.py runs/<run> [--steps 20] [--rounds 3]

From one demo run's lake and model, in one process:

1. Replay: ``ReplaySource`` (the lake as a subscriber, reading the run's rollouts
   table) drained into the learner's own ``Batcher`` (groups formed, batches
   taken): rollouts/s delivered as batches the learner could train on.
2. Learner: ``GRPOLearner.train_step`` on the demo's model with the demo's
   learner settings, on the first ``--steps`` of those batches: rollouts/s
   trained.

Medians over ``--rounds``. Ends with ``FIGURE replay_vs_learner_ratio``.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Import from the repository root, not bench/ (bench/storage.py would shadow the `storage` package).
sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import asyncio
import json
import statistics
import tempfile
import time


async def replay_into_batcher(reader, config) -> tuple[float, list]:
    from learner.batching import Batcher
    from storage.replay import ReplaySource

    src, batcher = ReplaySource(reader), Batcher(config)
    batches, rows = [], 0
    t0 = time.perf_counter()
    while not src.exhausted:
        for d in await src.poll(timeout_s=0.01, max_records=1024):
            batcher.add(d)
            rows += 1
        while (batch := batcher.ready(version=10**9)) is not None:
            batches.append(batch)
    elapsed = time.perf_counter() - t0
    await src.close()
    return sum(len(g) for b in batches for g in b) / elapsed, batches


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--steps", type=int, default=20, help="learner steps timed per round")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from conveyor.objectstore import LocalObjectStore
    from conveyor.topics import Topics
    from conveyor.transport.memory import MemoryTransport
    from launch.demo import demo_run_config
    from learner.recipe import GRPOLearner
    from storage.lake import LakeReader

    run_dir = args.run_dir.resolve()
    run_id = json.loads((run_dir / "config.json").read_text())["run_id"]
    store = LocalObjectStore(run_dir.parent / "objects")
    # In process: the bench times the step itself, not the pipe to a child.
    config = demo_run_config().learner.model_copy(update={"step_process": False, "max_lag": 10**9})
    tok = AutoTokenizer.from_pretrained(run_dir / "model")
    torch.manual_seed(0)
    replay_rates, learner_rates = [], []
    for _ in range(args.rounds):
        rate, batches = asyncio.run(replay_into_batcher(LakeReader(store, run_id), config))
        replay_rates.append(rate)
        model = AutoModelForCausalLM.from_pretrained(run_dir / "model")
        with tempfile.TemporaryDirectory() as tmp:
            learner = GRPOLearner(MemoryTransport(), Topics(run_id), model, tok.pad_token_id, LocalObjectStore(Path(tmp) / "o"),
                                  config, run_dir=Path(tmp))  # fmt: skip
            learner.version = max(s.rollout.min_policy_version for b in batches[: args.steps] for g in b for s in g)
            learner.train_step(batches[0])  # warm: allocator, kernels
            t0 = time.perf_counter()
            trained = 0
            for batch in batches[1 : args.steps + 1]:
                learner.train_step(batch)
                trained += sum(len(g) for g in batch)
            learner_rates.append(trained / (time.perf_counter() - t0))
            learner.close()
        print(f"round: replay into the batcher {rate:.0f} rollouts/s ({len(batches)} batches), "
              f"learner {learner_rates[-1]:.0f} rollouts/s")  # fmt: skip
    r, lr = statistics.median(replay_rates), statistics.median(learner_rates)
    print(f"FIGURE replay_into_batcher_rollouts_per_s {r:.0f} per_s")
    print(f"FIGURE learner_rollouts_per_s {lr:.0f} per_s")
    print(f"FIGURE replay_vs_learner_ratio {r / lr:.1f} x")


if __name__ == "__main__":
    main()
