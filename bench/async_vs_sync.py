"""Asynchronous pipeline vs the same pipeline in lock step, same seed and budget.

Runs ``conveyor demo`` twice per seed, each run in a fresh process: ``--sync`` (max_lag 0:
generate, then score, then train) and asynchronous (``--max-lag``, the demo's by default: generation,
scoring and training overlap on the two cores), each for ``--budget`` seconds
of RL, keeping every published weights version in the run's object store.

Time to threshold is measured after the runs (``--eval-every 0``, the
default): on a wall-clock grid (``--grid`` seconds) the newest version each
run had published at that time is evaluated on ``--heldout`` held-out
problems (greedy, judged by the reward service's verifier in the sandbox),
and the figure is the lock-step run's first grid time at or above
``--threshold`` divided by the asynchronous run's. The default threshold, 0.9,
is the phase of the demo's task that takes learning (RL separating ``max`` from
``min``, which the warm-up confuses; docs/BENCHMARKS.md, "Why 0.9 and lag 3"):
lock step reaches 0.8 and 0.85 within 2.5-7 s (5-14 points of the 0.5-s grid), where
the grid and the first batches decide the ratio. Both runs are sampled at
the same times, so neither gets more chances to touch the threshold, and no
evaluation competes with the pipeline for the two cores while it runs.
``--eval-every S`` instead evaluates every S seconds inside the runs (the
demo's own display; 100 problems).

    python bench/async_vs_sync.py [--seeds 0 1 2] [--budget 40] [--threshold 0.9] [--max-lag N] [--updates-per-batch N] [--no-engine-process] [--no-learner-process]

With several seeds the figure is the geometric mean of the per-seed ratios
(``async_speedup_total`` is the ratio of the summed times) over the seeds both
runs brought to the threshold; a seed that one run or neither reached within
the budget is listed with the summary, and the other seeds still count. The
summary also gives the figure at 0.8, 0.85 and 0.9 (offline evaluation: the
same evaluated versions). With two or more such seeds it gives a 95% interval for
the figure (Student's t over the per-seed log ratios): on these machines a seed's
ratio moves by tens of percent from run to run, and the interval says how far the
figure is from the goal. Ends with ``FIGURE async_speedup <v> x``; exits 1 if no
seed reached the threshold in both runs.

Every invocation writes its per-seed times to ``<out>/async_vs_sync-<stamp>.json``;
``--combine FILE...`` summarises several of them as one set of seeds (the same
settings, each seed once), so seeds run in separate invocations, or interleaved
with another setting in the same hour, count together:

    python bench/async_vs_sync.py --combine runs/bench/async_vs_sync-*.json [--threshold 0.9]
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

if not __package__:  # run as a script: the repository root, not bench/, on the path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

# The arguments that must match for invocations to be summarised together (--combine).
SETTINGS = (
    "budget",
    "eval_every",
    "grid",
    "heldout",
    "async_objective",
    "engine_process",
    "learner_process",
    "max_lag",
    "updates_per_batch",
)


def geomean(ratios) -> float:
    return math.exp(statistics.fmean(math.log(r) for r in ratios))


def interval(ratios: list[float], confidence: float = 0.95) -> tuple[float, float] | None:
    """Confidence interval of the geometric mean of ``ratios`` (Student's t on their
    logarithms), or None under two ratios."""
    if len(ratios) < 2:
        return None
    from scipy import stats

    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    half = stats.t.ppf(0.5 + confidence / 2, len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean - half), math.exp(mean + half)


def summarise(times: dict[int, dict[str, float | None]]) -> dict:
    """Per-seed times to a threshold (``None``: not reached within the budget) to the
    figure: the geometric mean of the ratios of the seeds both runs reached (and the
    ratio of their summed times); the seeds only one run reached are listed, not
    dropped silently (a seed only the asynchronous run reached is a speedup of at
    least budget / its time, one only lock step reached a loss)."""
    out: dict = {"ratios": {}, "async_only": [], "sync_only": [], "neither": []}
    summed = {"sync": 0.0, "async": 0.0}
    for seed, t in sorted(times.items()):
        s, a = t["sync"], t["async"]
        if s is None or a is None:
            out["neither" if s is None and a is None else "async_only" if s is None else "sync_only"].append(seed)
            continue
        out["ratios"][seed] = 1.0 if s == a else s / a  # (both 0.0: the warmed-up model already passes)
        summed["sync"] += s
        summed["async"] += a
    ratios = list(out["ratios"].values())
    out["geo"] = geomean(ratios) if ratios else None
    # (only seeds that both passed at 0.0: a ratio of one, as each of them is)
    out["summed"] = (summed["sync"] / summed["async"] if summed["async"] > 0 else 1.0) if ratios else None
    out["interval"] = interval(ratios)
    return out


def describe(threshold: float, summary: dict) -> str:
    geo, summed = summary["geo"], summary["summed"]
    text = f"at {threshold}: " + (f"{geo:.2f} x (summed {summed:.2f} x)" if geo is not None else "no ratio")
    n = len(summary["ratios"])
    text += f" over {n} seed{'' if n == 1 else 's'}"
    if summary.get("interval"):
        text += ", 95% interval {:.2f}-{:.2f}".format(*summary["interval"])
    for key, what in (
        ("async_only", "only the asynchronous run reached it"),
        ("sync_only", "only lock step reached it"),
        ("neither", "neither reached it"),
    ):
        if summary[key]:
            text += f"; {what}: seeds {summary[key]}"
    return text


def save(
    out_dir: Path,
    settings: dict,
    times: dict,
    step_ratios: dict[int, float],
    stamp: str,
    paces: dict[int, dict[str, float]] | None = None,
) -> Path:
    """One invocation's per-seed times, for ``--combine``; ``paces``: per seed, each run's
    learner steps per second (the machine's pace: the same code runs 2-5x slower on some
    of these machines than on others, and the ratio moves with it)."""
    path = out_dir / f"async_vs_sync-{stamp}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(
            {
                "settings": settings,
                "times": {str(th): {str(seed): t for seed, t in by_seed.items()} for th, by_seed in times.items()},
                "step_ratios": {str(seed): r for seed, r in step_ratios.items()},
                "steps_per_s": {str(seed): p for seed, p in (paces or {}).items()},
            },
            indent=1,
        )
    )
    return path


def combine(paths: list[Path]) -> tuple[dict, dict, dict[int, float], dict[int, dict[str, float]]]:
    """Several invocations' files as one set of seeds: (settings, times, step_ratios, paces).
    Refuses files whose settings differ (naming the field) and a seed given twice."""
    settings: dict | None = None
    times: dict[float, dict[int, dict]] = {}
    step_ratios: dict[int, float] = {}
    paces: dict[int, dict[str, float]] = {}
    seen: dict[int, Path] = {}
    for path in paths:
        data = json.loads(Path(path).read_text())
        if settings is None:
            settings, first = data["settings"], path
        for key in sorted(set(settings) | set(data["settings"])):
            if settings.get(key) != data["settings"].get(key):
                raise SystemExit(
                    f"{path}: {key} is {data['settings'].get(key)!r}, {first} has {settings.get(key)!r}: "
                    "only runs with the same settings are summarised together"
                )
        for seed, r in data["step_ratios"].items():
            if int(seed) in seen:
                raise SystemExit(f"seed {seed} is in both {seen[int(seed)]} and {path}: each seed counts once")
            seen[int(seed)] = path
            step_ratios[int(seed)] = r
        for seed, p in data.get("steps_per_s", {}).items():  # (files from before it was recorded have none)
            paces[int(seed)] = p
        for th, by_seed in data["times"].items():
            for seed, t in by_seed.items():
                times.setdefault(float(th), {})[int(seed)] = t
    if settings is None:
        raise SystemExit("--combine: no files")
    return settings, times, step_ratios, paces


def report(
    times: dict[float, dict[int, dict]],
    step_ratios: dict[int, float],
    threshold: float,
    budget: float,
    paces: dict[int, dict[str, float]] | None = None,
) -> None:
    """The summary lines and the FIGUREs; exits 1 when no seed reached ``threshold`` in both runs."""
    if paces:
        sync = sorted(p["sync"] for p in paces.values())
        print(
            f"lock-step pace (the machine's): {sync[0]:.2f}-{sync[-1]:.2f} steps/s over {len(sync)} seed{'' if len(sync) == 1 else 's'}"
        )
    for th in sorted(times):
        print(describe(th, summarise(times[th])) + (" (the figure)" if th == threshold else ""))
    main_summary = summarise(times.get(threshold, {}))
    ratios = list(step_ratios.values())
    if ratios:
        print(f"FIGURE async_steps_per_s_ratio {geomean(ratios):.2f} x")
    if main_summary["geo"] is None:
        print(f"no seed reached {threshold} in both runs within {budget} s: no figure")
        raise SystemExit(1)
    print(f"FIGURE async_speedup_total {main_summary['summed']:.2f} x")
    print(f"FIGURE async_speedup {main_summary['geo']:.2f} x")


def time_to(evals: list[dict], threshold: float) -> float | None:
    for e in evals:
        if e["pass_rate"] >= threshold:
            return e["wall_s"]
    return None


class OfflineEval:
    """Held-out greedy pass rate of a run's published versions, read back from its store."""

    def __init__(self, result, out_dir: Path, heldout: int) -> None:
        from conveyor.objectstore import LocalObjectStore
        from launch.demo import Evaluator
        from rollout_workers.reference_engine import ReferenceEngine
        from sandbox.runner import Sandbox, SandboxLimits
        from tasks.suites.pyexpr import heldout_set, to_task

        self.run_id = result.run_dir.name
        self.model_dir = result.run_dir / "model"
        self.store = LocalObjectStore(out_dir.resolve() / "objects")
        self.engine = ReferenceEngine(self.model_dir, seed=0)
        tasks = [to_task(p, self.run_id, 1, i, "heldout") for i, p in enumerate(heldout_set(heldout))]
        self.sandbox = Sandbox(SandboxLimits(timeout_s=1.0), warm=True)
        self.evaluator = Evaluator(self.engine, self.sandbox, tasks)
        rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
        # A step's row is written right after its version was published (publish_every 1).
        self.published = sorted((r["wall_s"], r["version"]) for r in rows)
        self.rates: dict[int, float] = {}

    def version_at(self, t: float) -> int:
        return max((v for wall, v in self.published if wall <= t), default=0)

    def rate(self, version: int) -> float:
        if version not in self.rates:
            from safetensors.torch import load, load_file

            from conveyor import keys

            if version == 0:  # the warmed-up model the run started from
                state = load_file(self.model_dir / "model.safetensors")
            else:
                state = load(self.store.get(keys.weights_key(self.run_id, version)))
            self.engine.load_state_dict(state, version)
            self.rates[version] = self.evaluator.pass_rate()
        return self.rates[version]

    def time_to(self, threshold: float, grid: float, horizon: float) -> float | None:
        for i in range(int(horizon / grid) + 1):
            if self.rate(self.version_at(i * grid)) >= threshold:
                return i * grid
        return None


def main() -> None:
    from launch.demo import DemoConfig, demo_run_config, run_demo

    demo_learner = demo_run_config().learner

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--seed", type=int, default=None, help="one seed (same as --seeds S)")
    parser.add_argument("--budget", type=float, default=40.0, help="seconds of RL per run")
    parser.add_argument("--threshold", type=float, default=0.9)
    parser.add_argument(
        "--eval-every", type=float, default=0.0, help="evaluate inside the runs every this many seconds (0: after the runs)"
    )
    parser.add_argument("--grid", type=float, default=0.5, help="seconds between the evaluated times (after the runs)")
    parser.add_argument("--heldout", type=int, default=300, help="held-out problems per evaluation (after the runs)")
    parser.add_argument("--out", type=Path, default=Path("runs/bench"))
    parser.add_argument(
        "--async-objective", default="behaviour", help="the asynchronous run's objective (behaviour or decoupled)"
    )
    parser.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=DemoConfig.engine_process,
        help="both runs sample in a child process (the demo's default: %(default)s; --no-engine-process: in process)",
    )
    parser.add_argument(
        "--learner-process",
        action=argparse.BooleanOptionalAction,
        default=demo_learner.step_process,
        help="both runs' learners step in a child process (the demo's default: %(default)s; --no-learner-process: in process)",
    )
    parser.add_argument(
        "--max-lag",
        type=int,
        default=demo_learner.max_lag,
        help="the asynchronous run's max_lag (the demo's default: %(default)s; the lock-step run has 0)",
    )
    parser.add_argument(
        "--updates-per-batch",
        type=int,
        default=demo_learner.updates_per_batch,
        help="both runs' optimizer updates per step's batch (the demo's default: %(default)s)",
    )
    parser.add_argument(
        "--combine",
        type=Path,
        nargs="+",
        metavar="FILE",
        help="summarise earlier invocations' async_vs_sync-*.json as one set of seeds; runs nothing",
    )
    args = parser.parse_args()

    if args.combine:
        settings, times, step_ratios, paces = combine(args.combine)
        print("settings: " + ", ".join(f"{k} {v}" for k, v in sorted(settings.items())))
        if args.threshold not in times:
            raise SystemExit(f"--threshold {args.threshold}: the files hold {sorted(times)}")
        report(times, step_ratios, args.threshold, settings["budget"], paces)
        return

    seeds = [args.seed] if args.seed is not None else args.seeds
    stamp = time.strftime("%Y%m%d-%H%M%S")
    # times[threshold][seed][mode]: seconds of RL to the threshold, None if not reached
    thresholds = sorted({args.threshold} | ({0.8, 0.85, 0.9} if args.eval_every == 0 else set()))
    times: dict[float, dict[int, dict[str, float | None]]] = {th: {} for th in thresholds}
    step_ratios: dict[int, float] = {}
    paces: dict[int, dict[str, float]] = {}
    for seed in seeds:
        steps_per_s = {}
        for mode in ("sync", "async"):
            learner = {
                "step_process": args.learner_process,
                "max_lag": args.max_lag,
                "updates_per_batch": args.updates_per_batch,
                "objective": args.async_objective if mode == "async" else "behaviour",
                "keep_versions": 1_000_000 if args.eval_every == 0 else 3,
            }
            cfg = DemoConfig.create(
                {"learner": learner},
                seed=seed,
                sync=mode == "sync",
                rl_budget_s=args.budget,
                eval_every_s=args.eval_every,
                target_pass_rate=args.threshold if args.eval_every > 0 else None,
                out_dir=args.out,
                # A fresh run id: an existing one would resume from that run's checkpoint.
                run_id=f"bench-{mode}-s{seed}{'-proc' if args.engine_process else ''}{'-lproc' if args.learner_process else ''}-lag{0 if mode == 'sync' else args.max_lag}-u{args.updates_per_batch}-{stamp}",
                engine_process=args.engine_process,
            )
            # Each run in a fresh process: nothing of an earlier run (threads, heap, caches) shares
            # the two cores with it.
            with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
                r = pool.submit(run_demo, cfg).result()
            if args.eval_every > 0:
                times[args.threshold].setdefault(seed, {})[mode] = time_to(r.evals, args.threshold)
            else:
                offline = OfflineEval(r, args.out, args.heldout)
                for th in thresholds:
                    times[th].setdefault(seed, {})[mode] = offline.time_to(th, args.grid, r.rl_time_s)
                (r.run_dir / "heldout_by_version.json").write_text(
                    json.dumps({"heldout": args.heldout, "published": offline.published, "pass_rate": offline.rates})
                )
                offline.sandbox.close()
            steps_per_s[mode] = r.steps / r.rl_time_s
            print(
                f"seed {seed} {mode:5s}: start {r.heldout_start:.2f} end {r.heldout_end:.2f} steps {r.steps} "
                f"rl {r.rl_time_s:.0f}s time to "
                + ", ".join(f"{th}: {times[th][seed][mode]}" for th in thresholds)
                + f"; max staleness {r.max_staleness}",
                flush=True,
            )
        step_ratios[seed] = steps_per_s["async"] / steps_per_s["sync"]
        paces[seed] = steps_per_s
        t = times[args.threshold][seed]
        ratio = summarise({seed: t})["ratios"].get(seed)
        print(
            f"seed {seed}: async_speedup {'not measured (' + str(t) + ')' if ratio is None else f'{ratio:.2f} x'}, "
            f"steps/s ratio {step_ratios[seed]:.2f}",
            flush=True,
        )
        # Written after every seed: an invocation cut short still leaves the seeds it finished.
        path = save(args.out, {k: getattr(args, k) for k in SETTINGS}, times, step_ratios, stamp, paces)
    print(f"per-seed times: {path} (--combine)")
    report(times, step_ratios, args.threshold, args.budget, paces)


if __name__ == "__main__":
    main()
