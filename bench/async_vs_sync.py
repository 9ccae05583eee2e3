"""Asynchronous pipeline vs the same pipeline in lock step, same seed and budget.

Runs ``conveyor demo`` twice in this process: ``--sync`` (max_lag 0: generate,
then score, then train) and asynchronous (max_lag 1: generation, scoring and
training overlap on the two cores). Both evaluate the held-out greedy pass
rate every ``--eval-every`` seconds of wall time (the same evaluation cost
per second in both runs). The figure is the lock-step run's wall
time to reach the threshold divided by the asynchronous run's.

    python bench/async_vs_sync.py [--seeds 0 1 2] [--budget 150] [--threshold 0.8] [--engine-process]

Time-to-threshold on one seed carries the evaluation cadence and where each
run's held-out curve happens to cross: with several seeds the figure is the
geometric mean of the per-seed ratios (``async_speedup_total`` is the ratio
of the summed times). Ends with ``FIGURE async_speedup <v> x``.
"""

from __future__ import annotations

import argparse
import math
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
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--seed", type=int, default=None, help="one seed (same as --seeds S)")
    parser.add_argument("--budget", type=float, default=150.0, help="seconds of RL per run")
    parser.add_argument("--threshold", type=float, default=0.8)
    parser.add_argument("--eval-every", type=float, default=2.0, help="seconds between held-out evaluations")
    parser.add_argument("--out", type=Path, default=Path("runs/bench"))
    parser.add_argument("--engine-process", action="store_true", help="both runs sample in a child process")
    args = parser.parse_args()

    seeds = [args.seed] if args.seed is not None else args.seeds
    ratios, times, step_ratios = [], {"sync": 0.0, "async": 0.0}, []
    for seed in seeds:
        reached, steps_per_s = {}, {}
        for mode in ("sync", "async"):
            cfg = DemoConfig(
                seed=seed,
                sync=mode == "sync",
                rl_budget_s=args.budget,
                eval_every_s=args.eval_every,
                target_pass_rate=args.threshold,
                out_dir=args.out,
                run_id=f"bench-{mode}-s{seed}{'-proc' if args.engine_process else ''}",
                engine_process=args.engine_process,
            )
            r = run_demo(cfg)
            reached[mode] = time_to(r.evals, args.threshold)
            steps_per_s[mode] = r.steps / r.rl_time_s
            print(
                f"seed {seed} {mode:5s}: start {r.heldout_start:.2f} end {r.heldout_end:.2f} steps {r.steps} "
                f"rl {r.rl_time_s:.0f}s time-to-{args.threshold} {reached[mode] if reached[mode] is None else round(reached[mode], 1)} "
                f"max staleness {r.max_staleness}",
                flush=True,
            )
        if reached["sync"] is None or reached["async"] is None:
            print(f"seed {seed}: threshold {args.threshold} not reached within {args.budget}s ({reached})")
            raise SystemExit(1)
        ratios.append(reached["sync"] / reached["async"])
        step_ratios.append(steps_per_s["async"] / steps_per_s["sync"])
        for mode in times:
            times[mode] += reached[mode]
        print(f"seed {seed}: async_speedup {ratios[-1]:.2f} x, steps/s ratio {step_ratios[-1]:.2f}", flush=True)
    geo = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    print(f"FIGURE async_steps_per_s_ratio {math.exp(sum(math.log(r) for r in step_ratios) / len(step_ratios)):.2f} x")
    print(f"FIGURE async_speedup_total {times['sync'] / times['async']:.2f} x")
    print(f"FIGURE async_speedup {geo:.2f} x")


if __name__ == "__main__":
    main()
