"""``conveyor report``: a run's curves as a PNG and a one-file HTML page, from its metrics."""

from __future__ import annotations

import json
import math

import pytest

from launch.report import summary, write_report

pytestmark = pytest.mark.unit


def _rows(n: int) -> list[dict]:
    return [
        {"step": i, "version": i, "wall_s": 2.0 * i, "reward_mean": 0.3 + 0.5 * i / n, "reward_std": 0.2,
         "pass_rate": 0.3 + 0.5 * i / n, "kl": 0.01 * i, "entropy": 2.0 - i / n, "loss": -0.1, "grad_norm": 1.5,
         "trained_samples": 32, "tokens": 640, "staleness": {"0": 24, "1": 8} if i % 2 else {"0": 32},
         "wait_s": 0.5, "step_s": 1.2, "publish_s": 0.3}
        for i in range(1, n + 1)
    ]  # fmt: skip


def test_the_report_draws_every_curve_and_tabulates_the_run(tmp_path):
    steps = _rows(60)
    steps.insert(10, {**steps[9], "loss": None, "kl": None, "trained_samples": 0})  # a batch that trained nothing
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    evals = [{"version": v, "wall_s": 2.0 * v, "pass_rate": 0.5 + v / 200} for v in (0, 30, 60)]
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))
    png = write_report(tmp_path)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 30_000
    page = (tmp_path / "report.html").read_text()
    assert "data:image/png;base64," in page and "<th>heldout_last</th><td>0.8</td>" in page
    figures = summary(steps, evals)
    assert figures["steps"] == 60 and figures["samples_trained"] == 60 * 32 and figures["max_staleness"] == 1
    assert figures["reward_first_20_steps"] < figures["reward_last_20_steps"]
    assert math.isclose(
        figures["time_waiting_for_data"] + figures["time_computing"] + figures["time_publishing"], 1.0, abs_tol=0.01
    )


def test_a_run_without_steps_still_gets_a_report(tmp_path):
    write_report(tmp_path)
    assert (tmp_path / "report.png").exists() and "<th>steps</th><td>0</td>" in (tmp_path / "report.html").read_text()
