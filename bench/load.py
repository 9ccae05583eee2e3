"""Load run: a distributed run on the local stack for ``--minutes``, every role its own
process (``conveyor run``'s supervisor), resident memory of every service sampled.

Each role's RSS is the sum over its process tree (a Celery reward worker's
pool children included), read from ``/proc`` every ``--sample-s`` seconds.
The level after warm-up is the median of the samples in the minute after
``--warmup-minutes``; the figure is the largest growth of any role above
that level over the rest of the run. The rate is samples consumed by the
learner per second (from its progress topic), and restarts of roles are
reported (a restarted role starts its memory over).

    python bench/load.py [--minutes 30] [--warmup-minutes 5] [--config examples/distributed.yaml]

Ends with ``FIGURE load_rss_growth_max <v> %`` and ``FIGURE load_samples_per_s <v> per_s``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import json
import os
import statistics
import tempfile
import time
import uuid


def tree_rss_mb(pid: int) -> float:
    """RSS of ``pid`` and all its descendants, in MiB."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    total, stack = 0, [pid]
    while stack:
        p = stack.pop()
        stack.extend(children.get(p, ()))
        try:
            with open(f"/proc/{p}/status") as fh:
                for line in fh:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
                        break
        except OSError:
            continue
    return total / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--warmup-minutes", type=float, default=5)
    ap.add_argument("--sample-s", type=float, default=15)
    ap.add_argument("--config", type=Path, default=Path("examples/distributed.yaml"))
    ap.add_argument("--out", type=Path, default=None, help="Where to write the samples (JSON lines)")
    args = ap.parse_args()

    from conveyor.cli.run import _default_model
    from conveyor.config import load_run_config
    from conveyor.orchestrate import Supervisor, resolve_for_stack, write_run_config
    from conveyor.stack.manager import Stack, StackPorts, free_port_block

    tmp = Path(tempfile.mkdtemp(prefix="bench-load-"))
    stack = Stack(tmp / "stack", StackPorts.from_base(free_port_block()))
    stack.up(["kafka", "s3", "redis"], timeout_s=90)
    sup = None
    samples: list[dict] = []
    try:
        cfg = load_run_config(args.config).model_copy(update={"run_id": f"load-{uuid.uuid4().hex[:6]}"})
        run_dir = tmp / "runs" / cfg.run_id
        path = write_run_config(run_dir, resolve_for_stack(cfg, stack.endpoints()))
        sup = Supervisor(run_dir, path, _default_model(tmp / "model", 300))
        sup.start()
        started = time.monotonic()
        next_sample = 0.0
        while (elapsed := time.monotonic() - started) < args.minutes * 60:
            sup.tick()
            if elapsed >= next_sample:
                row = {"t": round(elapsed, 1)}
                for name, role in sup.roles.items():
                    row[name] = round(tree_rss_mb(role.proc.pid), 1) if role.proc and role.proc.poll() is None else None
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
        level = [s[name] for s in samples if warm <= s["t"] < warm + 60 and s[name] is not None]
        later = [s[name] for s in samples if s["t"] >= warm + 60 and s[name] is not None]
        if level and later:
            base = statistics.median(level)
            growth[name] = {"after_warmup_mb": base, "max_mb": max(later), "growth_pct": round(100 * (max(later) / base - 1), 1)}
    for name, g in growth.items():
        print(f"{name}: {g['after_warmup_mb']:.0f} MiB after warm-up, max {g['max_mb']:.0f} MiB later ({g['growth_pct']:+.1f} %)")
    print(f"restarts: {restarts or 'none'}; learner: {progress}")
    rate = progress["samples_consumed"] / (args.minutes * 60) if progress else 0.0
    print(f"FIGURE load_rss_growth_max {max(g['growth_pct'] for g in growth.values()):.1f} %")
    print(f"FIGURE load_samples_per_s {rate:.1f} per_s")


def _learner_progress(run_dir: Path) -> dict | None:
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        return None
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return {"step": rows[-1].get("step") if rows else 0, "samples_consumed": sum(r.get("samples", 0) for r in rows)}


if __name__ == "__main__":
    main()
