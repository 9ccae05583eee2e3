"""The prepared GPU benchmark runs end to end (tiny shape, CPU), so it does not rot
while no machine with a GPU runs it."""

from __future__ import annotations

import subprocess
import sys

from conftest import ROOT


def test_learner_gpu_bench_smoke():
    res = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "learner_gpu.py"), "--smoke"], capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert "FIGURE learner_tokens_per_s" in res.stdout
    assert "FIGURE cp_gpu_memory_per_rank_ratio pending" in res.stdout  # its context-parallel case: no GPUs here
    # The one-call GPU script runs it per case and collects the figures (here the CPU's one case).
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu.py"), "--smoke"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "| sdpa | 512 |" in res.stdout and "FIGURE learner_tokens_per_s " in res.stdout
    assert "FIGURE learner_tokens_per_s pending" not in res.stdout


def test_packed_prompts_bench_smoke():
    """The shared-prompt packing bench checks its two variants agree before it times them."""
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "packed_prompts.py"), "--prompt", "16", "--completion", "8",
                          "--samples", "3", "--groups", "2", "--pack-tokens", "40", "--hidden", "64", "--layers", "1",
                          "--repeats", "1"], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    assert "FIGURE packed_shared_prompt_speedup" in res.stdout


def test_gil_contention_bench_smoke():
    res = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gil_contention.py"), "--steps", "20"], capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert "FIGURE gil_threads_slowdown" in res.stdout and "FIGURE gil_processes_slowdown" in res.stdout


def test_reward_rate_bench_smoke():
    """The reward tier's bench: batched and one-per-task runs publish a verdict for every rollout."""
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "reward_rate.py"), "--rollouts", "512", "--baseline-rollouts", "64"],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert res.returncode == 0, (res.stdout + res.stderr)[-2000:]
    assert "FIGURE reward_callable_rate" in res.stdout and "FIGURE reward_batching_speedup" in res.stdout
