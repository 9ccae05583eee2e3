"""Load run: a distributed run on the local stack for ``--minutes``, every role its own
process (``conveyor run``'s supervisor), resident memory of every service sampled.

Each role's resident memory (RSS) is summed over its process tree (a Celery
reward worker's pool children and its sandbox's fork server included), read
from ``/proc`` every ``--sample-s`` seconds. The programs being scored (the
descendants of the sandbox's fork server, ``harness.py``: one job at a time,
each bounded by the sandbox's memory limit and gone when it ends) are the
workload, not the service, and are counted apart: sampled while one runs,
they would make the reward worker look like a saw tooth (155 → 187 → 155 MiB).

The level after warm-up is the median of the samples in the minute after
``--warmup-minutes``. ``load_rss_growth_max``: the largest single sample of
any role later on, above its level. ``load_rss_level_growth_max``: the
largest one-minute median of any role later on, above its level (sustained
growth, not one sample). The rate is samples consumed by the
learner per second (from its progress topic), and restarts of roles are
reported (a restarted role starts its memory over).

    python bench/load.py [--minutes 30] [--warmup-minutes 5] [--config examples/distributed.yaml]

Ends with ``FIGURE load_rss_growth_max <v> %``, ``FIGURE load_rss_level_growth_max <v> %`` and
``FIGURE load_samples_per_s <v> per_s``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import json
import statistics
import tempfile
import time
import uuid


def tree_memory_mb(pid: int) -> tuple[float, float]:
    """RSS of ``pid`` and its descendants, in MiB: (the service's processes, the sandboxed jobs
    they are running: descendants of a sandbox fork server)."""
    import psutil

    service = jobs = 0
    stack = [(psutil.Process(pid), False)]
    while stack:
        proc, is_job = stack.pop()
        try:
            rss = proc.memory_info().rss
            fork_server = not is_job and any("harness.py" in a for a in proc.cmdline())
            kids = proc.children()
        except psutil.Error:  # gone meanwhile
            continue
        if is_job:
            jobs += rss
        else:
            service += rss
        stack.extend((k, is_job or fork_server) for k in kids)
    return service / 2**20, jobs / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--warmup-minutes", type=float, default=5)
    ap.add_argument("--sample-s", type=float, default=15)
    ap.add_argument("--config", type=Path, default=Path("examples/distributed.yaml"))
    ap.add_argument("--out", type=Path, default=None, help="Where to write the samples (JSON lines)")
    args = ap.parse_args()
    if args.minutes < args.warmup_minutes + 1.5:
        ap.error("--minutes must exceed --warmup-minutes by 1.5 at least (a minute to set the level, then samples to compare)")

    from conveyor.config import load_run_config
    from launch.demo import warmed_tiny_policy
    from launch.stack.manager import Stack, StackPorts, free_port_block
    from launch.supervisor import Supervisor, resolve_for_stack, write_run_config

    tmp = Path(tempfile.mkdtemp(prefix="bench-load-"))
    stack = Stack(tmp / "stack", StackPorts.from_base(free_port_block()))
    stack.up(["kafka", "s3", "redis"], timeout_s=90)
    sup = None
    samples: list[dict] = []
    try:
        cfg = load_run_config(args.config).model_copy(update={"run_id": f"load-{uuid.uuid4().hex[:6]}"})
        run_dir = tmp / "runs" / cfg.run_id
        path = write_run_config(run_dir, resolve_for_stack(cfg, stack.endpoints()))
        sup = Supervisor(run_dir, path, warmed_tiny_policy(tmp / "model", 300))
        sup.start()
        started = time.monotonic()
        next_sample = 0.0
        while (elapsed := time.monotonic() - started) < args.minutes * 60:
            sup.tick()
            if elapsed >= next_sample:
                row = {"t": round(elapsed, 1)}
                for name, role in sup.roles.items():
                    alive = role.proc and role.proc.poll() is None
                    rss, jobs = tree_memory_mb(role.proc.pid) if alive else (None, None)
                    row[name] = None if rss is None else round(rss, 1)
                    if jobs:
                        row[f"{name}:jobs"] = round(jobs, 1)
                samples.append(row)
                print(json.dumps(row), flush=True)
                next_sample += args.sample_s
            time.sleep(0.5)
        progress = _learner_progress(run_dir)
        restarts = {n: r.restarts for n, r in sup.roles.items() if r.restarts}
    finally:
        if sup is not None:
            sup.stop()
        stack.down(grace_s=3)
    if args.out:
        args.out.write_text("\n".join(json.dumps(s) for s in samples) + "\n")
    warm = args.warmup_minutes * 60
    growth = {}
    for name in sup.roles:
        rss, level = _growth(samples, name, warm, level=False), _growth(samples, name, warm, level=True)
        if rss and level:
            growth[name] = (rss, level)
    for name, (rss, level) in growth.items():
        print(
            f"{name}: {rss[0]:.0f} MiB after warm-up, max sample {rss[1]:.0f} MiB later ({rss[2]:+.1f} %), "
            f"max one-minute level {level[1]:.0f} MiB ({level[2]:+.1f} %)"
        )
    print(f"restarts: {restarts or 'none'}; learner: {progress}")
    rate = progress["samples_consumed"] / (args.minutes * 60) if progress else 0.0
    print(f"FIGURE load_rss_growth_max {max(r[2] for r, _ in growth.values()):.1f} %")
    print(f"FIGURE load_rss_level_growth_max {max(p[2] for _, p in growth.values()):.1f} %")
    print(f"FIGURE load_samples_per_s {rate:.1f} per_s")


def _growth(samples: list[dict], key: str, warm: float, *, level: bool) -> tuple[float, float, float] | None:
    """(level after warm-up, highest later value, growth %) of ``key``. The level is the median of
    the minute after warm-up; later values are single samples, or (``level``) the median of each
    sample's trailing minute."""
    points = [(s["t"], s[key]) for s in samples if s.get(key) is not None]
    base = [v for t, v in points if warm <= t < warm + 60]
    if not base:
        return None
    if level:
        later = [statistics.median(v for u, v in points if t - 60 < u <= t) for t, _ in points if t >= warm + 60]
    else:
        later = [v for t, v in points if t >= warm + 60]
    if not later:
        return None
    b = statistics.median(base)
    return b, max(later), round(100 * (max(later) / b - 1), 1)


def _learner_progress(run_dir: Path) -> dict | None:
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        return None
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return {"step": rows[-1].get("step") if rows else 0, "samples_consumed": sum(r.get("samples", 0) for r in rows)}


if __name__ == "__main__":
    main()
