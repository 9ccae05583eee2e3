"""Where a demo step's time goes, lock step against asynchronous, and the speedup
the two cores allow at best.

Runs ``conveyor demo`` twice with the same seed (each in a fresh process):
``--sync`` and asynchronous (``--max-lag``, the demo's by default), ``--budget`` seconds of RL each, no
evaluation inside the runs. In each run it times the three stages where they
run (the learner's train step, the reference engine's batch generation, the
reward bridge's sandbox batch) and counts the CPU the whole machine spent
during the RL phase (``psutil.cpu_times``: the sandbox's processes included; run it
on an otherwise idle machine).

The bound: the asynchronous run overlaps stages, so it can at best spend the
lock-step run's CPU per step spread over every core without any extra, i.e.
``cpu_per_step / cores``. The best ratio it can reach is the lock-step run's
wall time per step divided by that (``async_bound``). Stages that already use
every core in the lock-step run (the sandbox runs its jobs two at a time) gain
nothing from overlapping; single-threaded ones (the learner, the engine, the
event loop) gain up to the number of cores.

    python bench/stage_times.py [--seed 0] [--budget 25] [--warmup-steps 800] [--max-lag N] [--keep-versions 3] [--updates-per-batch N] [--no-engine-process] [--no-learner-process]

Ends with ``FIGURE async_steps_per_s_ratio <v> x`` and ``FIGURE async_bound <v> x``.
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])  # the repository root, not bench/

from bench.machine import busy_cpu_s  # noqa: E402


def _timed(owner, name: str, totals: dict, label: str) -> None:
    import inspect

    fn = getattr(owner, name)
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return await fn(*a, **k)
            finally:
                totals[label] += time.perf_counter() - t

    else:

        @functools.wraps(fn)
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                totals[label] += time.perf_counter() - t

    setattr(owner, name, wrapper)


def one_run(
    mode: str,
    seed: int,
    budget: float,
    warmup_steps: int,
    out: Path,
    max_lag: int,
    keep_versions: int,
    engine_process: bool,
    learner_process: bool,
    updates_per_batch: int,
) -> dict:
    import launch.demo as demo
    import learner.recipe
    import reward.scorers
    import rollout_workers.process_engine
    import rollout_workers.reference_engine

    totals = {"train": 0.0, "generate": 0.0, "score": 0.0}
    _timed(learner.recipe.GRPOLearner, "train_step", totals, "train")
    engines = rollout_workers.process_engine.ProcessEngine if engine_process else rollout_workers.reference_engine.ReferenceEngine
    _timed(engines, "generate", totals, "generate")  # in the child's case: the call's round trip
    _timed(reward.scorers, "score_batch", totals, "score")
    phase: dict = {}
    run_services = demo._run_services

    learner_run = learner.recipe.GRPOLearner.run

    async def started(self, *a, **k):  # the services start together: the RL phase starts here
        phase["cpu"], phase["wall"] = busy_cpu_s(), time.monotonic()
        return await learner_run(self, *a, **k)

    async def measured(*a, **k):  # (building the services, a child process's start-up included, is not timed)
        try:
            return await run_services(*a, **k)
        finally:
            phase["cpu"] = busy_cpu_s() - phase["cpu"]
            phase["wall"] = time.monotonic() - phase["wall"]

    learner.recipe.GRPOLearner.run = started
    demo._run_services = measured
    learner_cfg = {
        "max_lag": max_lag,
        "keep_versions": keep_versions,
        "step_process": learner_process,
        "updates_per_batch": updates_per_batch,
    }
    cfg = demo.DemoConfig.create({"learner": learner_cfg}, seed=seed, sync=mode == "sync", engine_process=engine_process,
                                 rl_budget_s=budget, eval_every_s=0, warmup_steps=warmup_steps, out_dir=out,
                                 run_id=f"stages-{mode}-s{seed}-{time.strftime('%Y%m%d-%H%M%S')}")  # fmt: skip
    r = demo.run_demo(cfg)
    return {"steps": r.steps, "wall": phase["wall"], "cpu": phase["cpu"], **totals}


def main() -> None:
    from launch.demo import DemoConfig, demo_run_config

    demo_learner = demo_run_config().learner
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget", type=float, default=25.0, help="seconds of RL per run")
    ap.add_argument("--warmup-steps", type=int, default=800, help="the demo's default")
    ap.add_argument(
        "--max-lag", type=int, default=demo_learner.max_lag, help="the asynchronous run's (the demo's default: %(default)s)"
    )
    ap.add_argument(
        "--keep-versions", type=int, default=3, help="published versions the learner keeps (async_vs_sync.py keeps all)"
    )
    ap.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=DemoConfig.engine_process,
        help="both runs sample in a child process (ProcessEngine; the demo's default: %(default)s; --no-engine-process: in process)",
    )
    ap.add_argument(
        "--learner-process",
        action=argparse.BooleanOptionalAction,
        default=demo_learner.step_process,
        help="both runs' learners step in a child process (StepProcess; the demo's default: %(default)s; --no-learner-process: in process)",
    )
    ap.add_argument(
        "--updates-per-batch",
        type=int,
        default=demo_learner.updates_per_batch,
        help="both runs' optimizer updates per step's batch (the demo's default: %(default)s)",
    )
    ap.add_argument("--out", type=Path, default=Path("runs/bench"))
    args = ap.parse_args()
    cores = os.cpu_count() or 1
    runs = {}
    for mode in ("sync", "async"):
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            r = runs[mode] = pool.submit(
                one_run,
                mode,
                args.seed,
                args.budget,
                args.warmup_steps,
                args.out,
                args.max_lag,
                args.keep_versions,
                args.engine_process,
                args.learner_process,
                args.updates_per_batch,
            ).result()
        n = r["steps"]
        per = {k: r[k] / n * 1e3 for k in ("wall", "cpu", "train", "generate", "score")}
        rest = per["wall"] - per["train"] - per["generate"] - per["score"]
        print(f"{mode:5s}: {n} steps in {r['wall']:.1f} s; per step (ms): wall {per['wall']:.0f} = train {per['train']:.0f} "
              f"+ generate {per['generate']:.0f} + score {per['score']:.0f} + other {rest:.0f}"
              f"{' (stages overlap)' if mode == 'async' else ''}; CPU {per['cpu']:.0f} core-ms "
              f"({r['cpu'] / r['wall']:.2f} of {cores} cores busy)", flush=True)  # fmt: skip
    s, a = runs["sync"], runs["async"]
    sync_wall, sync_cpu = s["wall"] / s["steps"], s["cpu"] / s["steps"]
    bound = sync_wall / (sync_cpu / cores)
    extra = (a["cpu"] / a["steps"]) / sync_cpu - 1
    print(f"asynchronous CPU per step vs lock step: {extra:+.0%}")
    print(f"FIGURE async_steps_per_s_ratio {(a['steps'] / a['wall']) / (s['steps'] / s['wall']):.2f} x")
    print(f"FIGURE async_bound {bound:.2f} x")


if __name__ == "__main__":
    main()
