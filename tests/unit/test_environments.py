"""Environments users register for multi-turn agents: the rollout worker steps one with each of
the model's turns and hands its observations back as tool turns; the reward service scores the
episode by replaying its actions in a fresh instance; an environment that fails, or a task that
names none, is an ``error`` verdict or a refused task, and nothing stops."""

from __future__ import annotations

import math

import pytest

from conveyor.contracts import Task, VerifierSpec
from tasks import environments
from tasks.environments import Step, actions_of, replay

pytestmark = pytest.mark.unit


class CountTo:
    """Say the numbers 1, 2, ... up to the task's target, one per turn."""

    def reset(self, task: Task) -> str:
        self.target, self.n = int(task.verifier.data["target"]), 0
        return "say 1"

    def step(self, action: str) -> Step:
        if action.strip().startswith(str(self.n + 1)):
            self.n += 1
            return Step(f"ok, now {self.n + 1}", reward=self.n / self.target, done=self.n == self.target)
        return Step(f"no: say {self.n + 1}", reward=self.n / self.target)


class Broken(CountTo):
    def step(self, action: str) -> Step:
        raise RuntimeError("the simulator crashed")


class NotANumber(CountTo):
    def step(self, action: str) -> Step:
        return Step("?", reward=math.nan)


@pytest.fixture(autouse=True)
def _registered():
    environments.register("count_to", CountTo)
    environments.register("broken", Broken)
    environments.register("nan", NotANumber)
    yield
    for name in ("count_to", "broken", "nan"):
        environments.unregister(name)


def task(env: str = "count_to", target: int = 3, **kw) -> Task:
    return Task(task_id=f"{env}-{target}", run_id="r", prompt="Count.", group_size=2, max_turns=4,
                verifier=VerifierSpec(kind="environment", data={"environment": env, "target": target}), **kw)  # fmt: skip


def test_an_episode_is_scored_by_replaying_its_actions():
    done = replay(task(), ["1", "2", "3", "4"])  # done at 3: the fourth is never stepped
    assert (done.reward, done.verdict, done.details) == (1.0, "pass", {"env_steps": 4.0})
    part = replay(task(), ["1", "x"])
    assert (part.reward, part.verdict) == (pytest.approx(1 / 3), "fail")
    assert actions_of('["1", "2"]') == ["1", "2"] and actions_of("just text") == ["just text"]


@pytest.mark.parametrize(
    ("t", "why"),
    [
        (task("broken"), "environment broken: raised RuntimeError: the simulator crashed"),
        (task("nan"), "is not a finite number"),
        (task("nowhere"), "unknown environment 'nowhere'; known: "),
    ],
)
def test_a_failing_or_unknown_environment_is_an_error_verdict(t, why):
    v = replay(t, ["1"])
    assert v.verdict == "error" and why in v.feedback.message


def test_registration_by_config_imports_the_target_at_start():
    environments.configure({"from_config": "tests.unit.test_environments:CountTo"})
    assert "from_config" in environments.known()
    environments.unregister("from_config")
    with pytest.raises(environments.RegistryError, match="cannot import 'no_such_module:Env'"):
        environments.configure({"x": "no_such_module:Env"})


async def test_the_worker_drives_the_environment_and_the_bridge_replays_it(tmp_path):
    from learner.models import create_tiny_llama
    from reward.bridge import RewardBridge
    from reward.scorers import LocalScorer
    from rollout_workers.reference_engine import ReferenceEngine
    from tasks.suites.pyexpr import ALPHABET
    from tests.unit.test_rollout_worker import _pipeline

    create_tiny_llama(tmp_path / "m", ALPHABET, seed=3, hidden_size=32, layers=2, heads=2, intermediate_size=64,
                      max_positions=256)  # fmt: skip
    engine = ReferenceEngine(tmp_path / "m", seed=0)
    t = task()
    kw = {"prompt": t.prompt, "max_turns": 4, "verifier": t.verifier, "sampling": None}
    worker, rollouts, committed, error = await _pipeline(tmp_path, engine, n_tasks=2, task_kw=kw)
    assert error is None and rollouts
    for r in rollouts:
        roles = [x.role for x in r.turns]
        attempts = roles.count("assistant")
        assert roles == ["assistant", "tool"] * (attempts - 1) + ["assistant"]
        assert all(x.text.startswith(("ok, now", "no: say")) for x in r.turns if x.role == "tool")
    assert any(len(r.turns) > 1 for r in rollouts), "no episode went past its first turn"
    scored = await RewardBridge(None, None, LocalScorer(None), engine.decode).score(rollouts)
    for r, s in zip(rollouts, scored):
        want = replay(r.task, [x.text for x in r.turns if x.role == "assistant"])
        assert (s.reward, s.verdict) == (want.reward, want.verdict)


async def test_stop_strings_of_several_tokens_end_every_turn(tmp_path):
    """A task's stop strings end each attempt of an episode, as they end a single-turn completion:
    no assistant turn runs on past the first stop string in it."""
    from conveyor.contracts import SamplingParams
    from learner.models import create_tiny_llama
    from rollout_workers.reference_engine import ReferenceEngine
    from tasks.suites.pyexpr import ALPHABET
    from tests.unit.test_rollout_worker import _pipeline

    create_tiny_llama(tmp_path / "m", ALPHABET, seed=3, hidden_size=32, layers=2, heads=2, intermediate_size=64,
                      max_positions=256)  # fmt: skip
    stops = [a + b for a in "0123456789" for b in "0123456789"]  # two tokens each: cut in the text
    t = task()
    kw = {"prompt": t.prompt, "max_turns": 4, "verifier": t.verifier,
          "sampling": SamplingParams(max_tokens=24, stop=stops)}  # fmt: skip
    worker, rollouts, committed, error = await _pipeline(tmp_path, ReferenceEngine(tmp_path / "m", seed=0), n_tasks=2,
                                                         task_kw=kw)  # fmt: skip
    assert error is None and rollouts
    cut = 0
    for r in rollouts:
        for turn in (x for x in r.turns if x.role == "assistant"):
            ends = [turn.text.find(s) + len(s) for s in stops if s in turn.text]
            assert not ends or min(ends) == len(turn.text), turn.text
            cut += bool(ends)
    assert cut, "no attempt met a stop string"


def test_a_task_naming_an_unknown_environment_is_refused_at_intake(tmp_path, monkeypatch):
    """A typo is refused where the task enters (a file's record, an HTTP submission), with the field named,
    not after its rollouts were sampled."""
    import asyncio
    import json

    from unit.test_api_limits import call

    from producers.api import create_app
    from producers.loaders import load_tasks

    def record(tid, env):
        return {"task_id": tid, "prompt": "Count.", "verifier": {"kind": "environment", "data": {"environment": env}}}

    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in (record("a", "count_to"), record("b", "count_too"))) + "\n")
    result = load_tasks(path, "r", "plain", on_error="skip")
    assert [t.task_id for t in result.tasks] == ["a"]
    [error] = result.errors
    assert error.field == "verifier.data.environment" and "unknown environment 'count_too'" in error.reason

    monkeypatch.delenv("CONVEYOR_API_TOKENS", raising=False)
    from conveyor.transport.memory import MemoryBroker, MemoryTransport

    app = create_app(MemoryTransport(MemoryBroker()))

    async def go():
        await call(app, "POST", "/v1/runs", json={"run_id": "r"})
        ok = await call(app, "POST", "/v1/runs/r/tasks", json={"tasks": [record("a", "count_to")]})
        bad = await call(app, "POST", "/v1/runs/r/tasks", json={"tasks": [record("b", "count_too")]})
        assert ok.status_code == 202 and bad.status_code == 422
        assert "unknown environment 'count_too'" in json.dumps(bad.json())

    asyncio.run(go())
