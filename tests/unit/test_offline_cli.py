"""``conveyor train rft|dpo`` from a run's lake: each trains and saves a model that transformers
loads; a lake with nothing to train on is a clear exit 2, not a traceback."""

from __future__ import annotations

import json

import pytest
from scored_factory import scored_group
from typer.testing import CliRunner

from conveyor.objectstore import LocalObjectStore
from launch.cli.main import app
from storage.table import RolloutTable

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def _logging_left_alone(monkeypatch):
    """The CLI's callback would point structlog and logging at CliRunner's stderr, which is closed
    after the invocation: later tests' log lines would fail on it."""
    import conveyor.logging

    monkeypatch.setattr(conveyor.logging, "configure_logging", lambda *a, **kw: None)


@pytest.fixture
def lake(tmp_path):
    from learner.models import create_tiny_llama
    from tasks.suites.pyexpr import ALPHABET

    create_tiny_llama(tmp_path / "model", ALPHABET, hidden_size=32, layers=1, intermediate_size=64)
    store = LocalObjectStore(tmp_path / "objects")
    RolloutTable(store, "run-a").append([s for g in range(6) for s in scored_group("run-a", g, 4)])
    failing = [s for g in range(3) for s in scored_group("run-b", g, 2)]
    RolloutTable(store, "run-b").append([type(s)(rollout=s.rollout, reward=0.0, verdict="fail") for s in failing])
    return tmp_path


@pytest.mark.parametrize("recipe", ["rft", "dpo"])
def test_a_recipe_trains_from_the_lake_and_saves_a_loadable_model(lake, recipe):
    from transformers import AutoModelForCausalLM

    out = lake / f"out-{recipe}"
    res = CliRunner().invoke(app, ["train", recipe, "run-a", "--model", str(lake / "model"), "--out", str(out),
                                   "--store", str(lake / "objects"), "--epochs", "1", "--batch-size", "4"])  # fmt: skip
    assert res.exit_code == 0, res.output
    stats = json.loads((out / "offline_stats.json").read_text())
    assert stats["steps"] >= 1
    AutoModelForCausalLM.from_pretrained(out)


@pytest.mark.parametrize(("recipe", "why"), [("rft", "no passing trajectories"), ("dpo", "no preference pairs")])
def test_nothing_to_train_on_is_exit_2_with_the_reason(lake, recipe, why):
    res = CliRunner().invoke(app, ["train", recipe, "run-b", "--model", str(lake / "model"), "--out", str(lake / "x"),
                                   "--store", str(lake / "objects")])  # fmt: skip
    assert res.exit_code == 2 and why in res.output, res.output
    assert not (lake / "x").exists()


def test_the_recipes_read_the_same_from_arrow_tables_as_from_rollouts(lake):
    """The CLI feeds the recipes the lake's columns (no ScoredRollout per row): same examples, same pairs."""
    from learner.offline import dpo_pairs, passing_examples, samples_from_tables
    from storage.lake import LakeReader

    reader = LakeReader(LocalObjectStore(lake / "objects"), "run-a")
    assert passing_examples(samples_from_tables(reader.iter_tables())) == passing_examples(reader.iter())
    pairs = dpo_pairs(samples_from_tables(reader.iter_tables()))
    assert pairs and pairs == dpo_pairs(reader.iter())
