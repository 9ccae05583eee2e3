"""``conveyor report RUN_DIR``: a run's curves as ``report.png`` and ``report.html``.

Reads ``metrics.jsonl`` (one line per learner step) and ``eval.jsonl`` (held-out pass rate per
evaluated version) and draws, over wall time in RL: the training reward (mean and one standard
deviation), the training and held-out pass rates, KL to the reference and entropy, the learner's
loss and gradient norm, throughput (samples trained and completion tokens per second, and how the
learner's time splits between waiting for data, computing and publishing), and the staleness of
the samples of each step. The HTML page holds the same picture and a table of the run's figures,
in one file that opens anywhere.
"""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path


def _read(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _series(steps: list[dict], key: str) -> tuple[list[float], list[float]]:
    """(wall time, value) of the steps that have a number for ``key``."""
    pairs = [(s["wall_s"], s[key]) for s in steps if isinstance(s.get(key), (int, float)) and "wall_s" in s]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _rates(steps: list[dict], key: str, window: int = 10) -> tuple[list[float], list[float]]:
    """Per second over a sliding window of steps, of a per-step count (``trained_samples``, ``tokens``)."""
    xs, ys = [], []
    for i in range(window, len(steps)):
        dt = steps[i]["wall_s"] - steps[i - window]["wall_s"]
        if dt > 0:
            xs.append(steps[i]["wall_s"])
            ys.append(sum(float(s.get(key) or 0) for s in steps[i - window + 1 : i + 1]) / dt)
    return xs, ys


def summary(steps: list[dict], evals: list[dict]) -> dict:
    """The run's figures, as the report's table shows them."""
    last = steps[-1] if steps else {}
    first_rewards = [s["reward_mean"] for s in steps[:20] if s.get("reward_mean") is not None]
    last_rewards = [s["reward_mean"] for s in steps[-20:] if s.get("reward_mean") is not None]
    phases = {p: sum(float(s.get(f"{p}_s") or 0) for s in steps) for p in ("wait", "step", "publish")}
    total = sum(phases.values()) or 1.0
    return {
        "steps": last.get("step", 0),
        "version": last.get("version", 0),
        "wall_s": round(float(last.get("wall_s", 0.0)), 1),
        "samples_trained": sum(int(s.get("trained_samples") or 0) for s in steps),
        "reward_first_20_steps": round(sum(first_rewards) / len(first_rewards), 4) if first_rewards else None,
        "reward_last_20_steps": round(sum(last_rewards) / len(last_rewards), 4) if last_rewards else None,
        "heldout_first": evals[0].get("pass_rate") if evals else None,
        "heldout_last": evals[-1].get("pass_rate") if evals else None,
        "max_staleness": max((int(k) for s in steps for k in (s.get("staleness") or {})), default=0),
        "time_waiting_for_data": round(phases["wait"] / total, 3),
        "time_computing": round(phases["step"] / total, 3),
        "time_publishing": round(phases["publish"] / total, 3),
    }


def _draw(run_dir: Path, steps: list[dict], evals: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(16, 8.4))
    ax = axes[0][0]
    x, mean = _series(steps, "reward_mean")
    ax.plot(x, mean, color="tab:blue", label="mean")
    xs, std = _series(steps, "reward_std")
    if len(xs) == len(x) and std:
        ax.fill_between(x, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)], alpha=0.2, color="tab:blue")
    ax.set_title("training reward (mean ± std per step)")
    ax = axes[0][1]
    ax.plot(*_series(steps, "pass_rate"), color="tab:blue", alpha=0.6, label="training samples")
    if evals:
        ax.plot(
            [e["wall_s"] for e in evals],
            [e["pass_rate"] for e in evals],
            marker="o",
            color="tab:green",
            label="held out (greedy)",
        )
    ax.set_ylim(0, 1)
    ax.set_title("pass rate")
    ax = axes[0][2]
    ax.plot(*_series(steps, "kl"), color="tab:red", label="KL to the reference")
    ax.plot(*_series(steps, "entropy"), color="tab:purple", label="entropy")
    ax.set_title("KL and entropy")
    ax = axes[1][0]
    ax.plot(*_series(steps, "loss"), color="tab:gray", label="loss")
    ax.plot(*_series(steps, "grad_norm"), color="tab:orange", label="grad norm")
    ax.set_title("loss and gradient norm")
    ax = axes[1][1]
    ax.plot(*_rates(steps, "trained_samples"), color="tab:blue", label="samples trained / s")
    ax.set_ylabel("samples / s")
    twin = ax.twinx()
    twin.plot(*_rates(steps, "tokens"), color="tab:olive", label="tokens trained / s")
    twin.set_ylabel("tokens / s")
    twin.legend(loc="lower right", fontsize=8)
    ax.set_title("learner throughput")
    ax = axes[1][2]
    lags = sorted({int(k) for s in steps for k in (s.get("staleness") or {})})
    bottom = [0] * len(steps)
    for lag in lags:
        vals = [(s.get("staleness") or {}).get(str(lag), 0) for s in steps]
        ax.bar([s["step"] for s in steps], vals, bottom=bottom, label=f"lag {lag}", width=1.0)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_title("staleness of each step's samples (versions)")
    ax.set_xlabel("learner step")
    for row in axes:
        for a in row:
            if a is not axes[1][2]:
                a.set_xlabel("wall time in RL (s)")
            if a.get_legend_handles_labels()[0]:
                a.legend(fontsize=8)
    fig.suptitle(run_dir.name)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)


def write_report(run_dir: str | Path) -> Path:
    """Write ``report.png`` and ``report.html`` into ``run_dir``; the PNG's path."""
    run_dir = Path(run_dir)
    steps = _read(run_dir / "metrics.jsonl")
    evals = _read(run_dir / "eval.jsonl")
    png = run_dir / "report.png"
    _draw(run_dir, steps, evals, png)
    figures = summary(steps, evals)
    rows = "\n".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>" for k, v in figures.items())
    image = base64.b64encode(png.read_bytes()).decode()
    (run_dir / "report.html").write_text(
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(run_dir.name)}</title>"
        "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
        "th,td{border:1px solid #ccc;padding:4px 8px;text-align:left}</style></head><body>"
        f"<h1>{html.escape(run_dir.name)}</h1><table>{rows}</table>"
        f"<p><img alt='curves' src='data:image/png;base64,{image}'></p></body></html>\n"
    )
    return png
