"""Asynchronous pipeline vs the same pipeline in lock step, same seed and budget.

Runs ``conveyor demo`` twice in this process: ``--sync`` (max_lag 0: generate,
then score, then train) and asynchronous (max_lag 1: generation, scoring and
training overlap on the two cores). Both evaluate the held-out greedy pass
rate every ``--eval-every`` seconds of wall time (the same evaluation cost
per second in both runs). The figure is the lock-step run's wall
time to reach the threshold divided by the asynchronous run's.

    python bench/async_vs_sync.py [--seed 0] [--budget 150] [--threshold 0.8] [--engine-process]

Ends with ``FIGURE async_speedup <v> x``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])  # the repository root, not bench/


def time_to(evals: list[dict], threshold: float) -> float | None:
    for e in evals:
        if e["pass_rate"] >= threshold:
            return e["wall_s"]
    return None


def main() -> None:
    from conveyor.demo import DemoConfig, run_demo

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget", type=float, default=150.0, help="seconds of RL per run")
    parser.add_argument("--threshold", type=float, default=0.8)
    parser.add_argument("--eval-every", type=float, default=2.0, help="seconds between held-out evaluations")
    parser.add_argument("--out", type=Path, default=Path("runs/bench"))
    parser.add_argument("--engine-process", action="store_true", help="both runs sample in a child process")
    args = parser.parse_args()

    results = {}
    for mode in ("sync", "async"):
        cfg = DemoConfig(
            seed=args.seed,
            sync=mode == "sync",
            rl_budget_s=args.budget,
            eval_every_s=args.eval_every,
            target_pass_rate=args.threshold,
            out_dir=args.out,
            run_id=f"bench-{mode}-s{args.seed}{'-proc' if args.engine_process else ''}",
            engine_process=args.engine_process,
        )
        r = run_demo(cfg)
        results[mode] = r
        reached = time_to(r.evals, args.threshold)
        print(
            f"{mode:5s}: start {r.heldout_start:.2f} end {r.heldout_end:.2f} steps {r.steps} "
            f"rl {r.rl_time_s:.0f}s time-to-{args.threshold} {reached if reached is None else round(reached, 1)} "
            f"max staleness {r.max_staleness}",
            flush=True,
        )
    t_sync = time_to(results["sync"].evals, args.threshold)
    t_async = time_to(results["async"].evals, args.threshold)
    if t_sync is None or t_async is None:
        print(f"threshold {args.threshold} not reached within {args.budget}s (sync {t_sync}, async {t_async})")
        raise SystemExit(1)
    steps_per_s = {m: r.steps / r.rl_time_s for m, r in results.items()}
    print(f"FIGURE async_steps_per_s_ratio {steps_per_s['async'] / steps_per_s['sync']:.2f} x")
    print(f"FIGURE async_speedup {t_sync / t_async:.2f} x")


if __name__ == "__main__":
    main()
