"""``conveyor report RUN_DIR``: turn a run's metrics into ``report.png``.

Reads ``metrics.jsonl`` (one line per learner step) and ``eval.jsonl``
(held-out pass rate per evaluated version) and draws reward and held-out
pass rate over wall time, and the staleness of trained samples per step.
"""

from __future__ import annotations

import json
from pathlib import Path


def _read(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_report(run_dir: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    steps = _read(run_dir / "metrics.jsonl")
    evals = _read(run_dir / "eval.jsonl")
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ax = axes[0]
    if steps:
        ax.plot([s["wall_s"] for s in steps], [s["reward_mean"] for s in steps], color="tab:blue", alpha=0.8)
    ax.set_title("training reward (mean per step)")
    ax.set_xlabel("wall time in RL (s)")
    ax.set_ylim(0, 1)
    ax = axes[1]
    if evals:
        ax.plot([e["wall_s"] for e in evals], [e["pass_rate"] for e in evals], marker="o", color="tab:green")
    ax.set_title("held-out greedy pass rate")
    ax.set_xlabel("wall time in RL (s)")
    ax.set_ylim(0, 1)
    ax = axes[2]
    if steps:
        lags = sorted({int(k) for s in steps for k in s.get("staleness", {})})
        bottom = [0] * len(steps)
        for lag in lags:
            vals = [s.get("staleness", {}).get(str(lag), 0) for s in steps]
            ax.bar([s["step"] for s in steps], vals, bottom=bottom, label=f"lag {lag}", width=1.0)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.legend()
    ax.set_title("staleness of samples per step (versions)")
    ax.set_xlabel("learner step")
    fig.suptitle(run_dir.name)
    fig.tight_layout()
    out = run_dir / "report.png"
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out
