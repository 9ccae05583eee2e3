"""``conveyor demo --vision`` in short: a tiny vision-language model warmed up by a teacher that is
wrong on some pictures, then RL through the services on the visual suite, the tasks' pictures
kept by reference in the object store, the lake holding the references.

In lock step (``--sync``): which groups an asynchronous step trains on depends on which were
scored first, and beside three busy test workers the asynchronous run's trajectory went another
way (twice it never rose above its start in 60 and 100 steps, where alone it reaches 0.79 at
version 3). Lock step trains on the same batches however busy the machine is (0.48 -> 0.79 at
version 3 or 4, alone and beside three busy processes). Asynchronous RL is what the text demo's
and the distributed tests run."""

from __future__ import annotations

import os

import pytest

# The run is the first test's setup: its time counts against that test, beside other workers' tests.
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    from launch.demo import run_demo
    from launch.demo_config import DemoConfig

    run = {"learner": {"lr": LR}} if LR is not None else None
    cfg = DemoConfig.for_vision(run, seed=0, run_id="ci-vision", out_dir=tmp_path_factory.mktemp("runs"), max_steps=MAX_STEPS,
                                rl_budget_s=600, eval_every_s=5.0, target_pass_rate=TARGET, sync=True)  # fmt: skip
    return run_demo(cfg)


MAX_STEPS = 60
TARGET = 0.65
"""The run stops at the first evaluation (every 5 s) at or above this, else after ``MAX_STEPS``: the
held-out rate of this task swings by a few hundredths between versions once RL has found the
pictures' cue (one run read 0.43 at version 16 after 0.76 at version 9), so the test asks that it
gets there, as the demo shows, rather than where one version happens to stand."""
LR = float(os.environ["CONVEYOR_VISION_LR"]) if "CONVEYOR_VISION_LR" in os.environ else None  # None: the demo's
MARGIN = 0.10
"""The held-out pass rate must rise by this much. A learner that does not learn (``CONVEYOR_VISION_LR=1e-12``,
the same seed and settings) moves it by 0.00 (0.48 → 0.48 over 15 steps): the evaluation is greedy
on a fixed held-out set, so only new weights change it (docs/BENCHMARKS.md)."""


def test_the_held_out_pass_rate_rises(demo):
    assert demo.steps >= 1
    # The evaluation that reached the target (or the best of the run): versions published after it,
    # before the run stops, may stand lower (see TARGET).
    best = max(e["pass_rate"] for e in demo.evals)
    assert best >= demo.heldout_start + MARGIN, (demo.heldout_start, best, demo.evals)


def test_every_rollout_was_scored_and_stored_with_its_picture_references(demo):
    import json

    import polars as pl

    assert demo.published_rollouts > 0 and demo.scored_rollouts == demo.published_rollouts
    lake = pl.read_delta(
        str(demo.run_dir.parent / "objects" / "runs" / "ci-vision" / "rollouts"), columns=["rollout_id", "task_json"]
    )
    assert lake.height == lake["rollout_id"].n_unique() == demo.published_rollouts == demo.lake_rows
    task = json.loads(lake["task_json"][0])
    (image,) = [p for m in task["messages"] for p in m["content"] if isinstance(p, dict) and p.get("type") == "image"]
    stored = demo.run_dir.parent / "objects" / image["key"]
    assert stored.is_file() and len(lake["task_json"][0]) < 2048  # the lake holds the reference, the store the picture


def test_the_trained_model_exports_with_its_image_processor(demo, tmp_path):
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    from conveyor.objectstore import LocalObjectStore
    from storage.model_export import export_model

    store = LocalObjectStore(demo.run_dir.parent / "objects")
    info = export_model(store, "ci-vision", tmp_path / "out")
    assert "preprocessor_config.json" in info["files"]
    AutoModelForImageTextToText.from_pretrained(tmp_path / "out")
    AutoImageProcessor.from_pretrained(tmp_path / "out")
