"""Staleness robustness on the demo task: the same number of learner steps at
max_lag 0 (on-policy) and at max_lag 4 with no correction, with truncated
importance sampling (PPO-clip against the behaviour logprobs), and with the
decoupled objective.

    python bench/staleness.py [--seed 0] [--steps 120] [--heldout 200]

Every arm starts from the same warmed-up model (same seed) and trains the
same number of steps on the same task stream; at max_lag 4 the admission
control lets generation run up to four versions ahead of the learner (the
samples are really that stale: the staleness histogram is printed). The
held-out greedy pass rate at the end is the figure. Ends with
``FIGURE staleness_<arm>_heldout <v> fraction`` per arm and
``FIGURE staleness_best_corrected_vs_on_policy <v> x``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])  # the repository root, not bench/

ARMS = [
    ("on_policy_lag0", 0, "on_policy"),
    ("no_correction_lag4", 4, "on_policy"),
    ("truncated_is_lag4", 4, "behaviour"),
    ("decoupled_lag4", 4, "decoupled"),
]


def main() -> None:
    from launch.demo import DemoConfig, run_demo

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--heldout", type=int, default=200)
    ap.add_argument("--out", type=Path, default=Path("runs/bench-staleness"))
    args = ap.parse_args()
    results = {}
    for name, lag, objective in ARMS:
        cfg = DemoConfig.create({"learner": {"max_lag": lag, "objective": objective}}, seed=args.seed,
                                run_id=f"staleness-{name}-s{args.seed}", out_dir=args.out, rl_budget_s=3600,
                                max_steps=args.steps, eval_every_s=1e9, heldout_size=args.heldout)  # fmt: skip
        r = run_demo(cfg)
        results[name] = r.heldout_end
        print(f"{name}: held-out {r.heldout_start:.3f} -> {r.heldout_end:.3f} in {r.steps} steps, max staleness {r.max_staleness}",
              flush=True)  # fmt: skip
    for name, _, _ in ARMS:
        print(f"FIGURE staleness_{name}_heldout {results[name]:.3f} fraction")
    best = max(results["truncated_is_lag4"], results["decoupled_lag4"])
    print(f"FIGURE staleness_best_corrected_vs_on_policy {best / max(results['on_policy_lag0'], 1e-9):.3f} x")


if __name__ == "__main__":
    main()
