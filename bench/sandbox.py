"""Sandbox throughput and workspace snapshot latency.

1. Executions per second of a trivial Python program, sandboxed vs bare
   ``/usr/bin/python3 -c`` subprocesses (the interpreter the sandbox uses),
   at the same concurrency, in alternating rounds in one run. The sandbox
   side runs programs in batches (one bwrap launch per batch, a fork server
   inside, each parallel slot a supervisor in namespaces of its own that
   forks a model process per program: the reward service's in-process
   path). The per-rollout path of a Celery worker (one program per call on
   a warm sandbox, one per pool process) and a cold launch per program are
   reported too.
2. CPU per job, the whole machine counted (``psutil.cpu_times``: the client,
   bwrap, the harness, its supervisors and model processes), on a warm
   sandbox at ``--concurrency`` slots running batches of 24 distinct small
   programs with an assert (the demo's reward stage runs ~23 per step).
3. Snapshot and restore latency of a workspace over a 2,000-file tree, with
   edits, deletions and new files in the writable layer before each.

    python bench/sandbox.py [--n 256] [--concurrency 2] [--batch 64] [--rounds 3]

Ends with ``FIGURE sandbox_exec_ratio <v> x`` (batched), ``FIGURE sandbox_warm_single_ratio <v> x``,
``FIGURE sandbox_cold_single_ratio <v> x``, ``FIGURE sandbox_cpu_per_job_ms <v> ms``,
``FIGURE snapshot_latency_ms <v> ms`` and ``FIGURE restore_latency_ms <v> ms`` (p95 of each).
"""

from __future__ import annotations

import sys
from pathlib import Path

# Import from the repository root, not bench/ (bench/storage.py would shadow the `storage` package).
sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import statistics
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor


def bare(n: int, concurrency: int) -> float:
    def one(i: int) -> None:
        subprocess.run(["/usr/bin/python3", "-c", f"print({i})"], check=True, capture_output=True)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(n)))
    return n / (time.perf_counter() - t0)


def sandboxed(sandbox, n: int, batch: int, concurrency: int) -> float:
    from sandbox.runner import Job

    jobs = [Job(f"print({i})") for i in range(n)]
    t0 = time.perf_counter()
    chunks = [jobs[i : i + batch] for i in range(0, n, batch)]
    with ThreadPoolExecutor(max(1, concurrency // sandbox.parallel)) as pool:
        results = [r for rs in pool.map(sandbox.run, chunks) for r in rs]
    elapsed = time.perf_counter() - t0
    assert all(r.verdict == "pass" for r in results), [r for r in results if r.verdict != "pass"][:1]
    return n / elapsed


def one_per_call(sandboxes, n: int) -> float:
    """One program per call, one thread per sandbox (a Celery pool process each)."""
    from sandbox.runner import Job

    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(sandboxes)) as pool:
        results = list(pool.map(lambda i: sandboxes[i % len(sandboxes)].run([Job(f"print({i})")])[0], range(n)))
    assert all(r.verdict == "pass" for r in results)
    return n / (time.perf_counter() - t0)


def cpu_per_job(sandbox, batches: int = 40, size: int = 24) -> float:
    """Milliseconds of CPU (whole machine) per program, warm sandbox, demo-sized batches."""
    from bench.machine import busy_cpu_s

    prog = "def f(a):\n    return sorted(a)[-1]\nassert f([3, 1, {i}]) == max(3, {i})\nprint({i})\n"
    sandbox.run_batch([prog.format(i=-1)])
    c0 = busy_cpu_s()
    for b in range(batches):
        results = sandbox.run_batch([prog.format(i=b * size + i) for i in range(size)])
        assert all(r.verdict == "pass" for r in results), results[0]
    return (busy_cpu_s() - c0) / (batches * size) * 1000


def snapshot_latency(sandbox, iterations: int) -> tuple[list[float], list[float]]:
    from sandbox.runner import Job
    from sandbox.workspace import Workspace

    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        for i in range(2000):
            p = base / f"pkg{i % 20}" / f"mod{i}.py"
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(f"VALUE = {i}\n")
        snaps, restores = [], []
        with Workspace(base, root=Path(tmp) / "ws") as ws:
            edit = Job(
                kind="command",
                argv=("/bin/sh", "-c", "for i in $(seq 0 50 1999); do echo x >> pkg0/mod$i.py 2>/dev/null; done;"
                      " rm -f pkg1/mod1*.py; mkdir -p new; for i in $(seq 1 50); do echo $i > new/f$i; done"),
            )  # fmt: skip
            for _ in range(iterations):
                assert sandbox.run([edit], ws)[0].verdict == "pass"
                t0 = time.perf_counter()
                sid = ws.snapshot()
                snaps.append((time.perf_counter() - t0) * 1000)
                assert sandbox.run([edit], ws)[0].verdict == "pass"
                t0 = time.perf_counter()
                ws.restore(sid)
                restores.append((time.perf_counter() - t0) * 1000)
                if len(ws.snapshots) > 32:
                    ws.reset()
    return snaps, restores


def p95(xs: list[float]) -> float:
    return sorted(xs)[max(0, int(len(xs) * 0.95) - 1)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=256, help="programs per round and side")
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--batch", type=int, default=64, help="programs per sandbox launch")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--snapshots", type=int, default=30)
    args = ap.parse_args()

    from sandbox.runner import Sandbox, SandboxLimits

    sandbox = Sandbox(SandboxLimits(timeout_s=5.0), parallel=args.concurrency)
    cold = [Sandbox(SandboxLimits(timeout_s=5.0), parallel=1) for _ in range(args.concurrency)]
    warm = [Sandbox(SandboxLimits(timeout_s=5.0), parallel=1, warm=True) for _ in range(args.concurrency)]
    print(f"cgroups: {sandbox.cgroup_version or 'none'}; concurrency {args.concurrency}; batch {args.batch}")
    bare_rates, sb_rates, warm_rates, cold_rates = [], [], [], []
    for r in range(args.rounds):
        bare_rates.append(bare(args.n, args.concurrency))
        sb_rates.append(sandboxed(sandbox, args.n, args.batch, args.concurrency))
        warm_rates.append(one_per_call(warm, args.n))
        cold_rates.append(one_per_call(cold, max(32, args.n // 4)))
        print(f"round {r}: bare {bare_rates[-1]:.1f}/s  batched {sb_rates[-1]:.1f}/s  "
              f"warm one-per-call {warm_rates[-1]:.1f}/s  cold one-launch-per-program {cold_rates[-1]:.1f}/s")  # fmt: skip
    b, s = statistics.median(bare_rates), statistics.median(sb_rates)
    w, one = statistics.median(warm_rates), statistics.median(cold_rates)
    cpu_warm = Sandbox(SandboxLimits(timeout_s=5.0), parallel=args.concurrency, warm=True)
    cpu_ms = statistics.median(cpu_per_job(cpu_warm) for _ in range(args.rounds))
    cpu_warm.close()
    print(f"CPU per job (warm, batches of 24, {args.concurrency} slots): {cpu_ms:.2f} ms")
    snaps, restores = snapshot_latency(sandbox, args.snapshots)
    print(f"snapshot ms: median {statistics.median(snaps):.2f} max {max(snaps):.2f}; "
          f"restore ms: median {statistics.median(restores):.2f} max {max(restores):.2f}")  # fmt: skip
    print(f"FIGURE sandbox_exec_rate {s:.1f} per_s")
    print(f"FIGURE bare_exec_rate {b:.1f} per_s")
    print(f"FIGURE sandbox_exec_ratio {s / b:.2f} x")
    print(f"FIGURE sandbox_warm_single_ratio {w / b:.2f} x")
    print(f"FIGURE sandbox_cold_single_ratio {one / b:.2f} x")
    print(f"FIGURE sandbox_cpu_per_job_ms {cpu_ms:.2f} ms")
    print(f"FIGURE snapshot_latency_ms {p95(snaps):.2f} ms")
    print(f"FIGURE restore_latency_ms {p95(restores):.2f} ms")
    for sb in [sandbox, *cold, *warm]:
        sb.close()


if __name__ == "__main__":
    main()
