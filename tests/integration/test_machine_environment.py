"""Environments that need a machine: the episode's workspace in the bubblewrap sandbox, kept across
steps, snapshotted before each and rolled back when a step fails; the rollout worker drives it on
its tool sandbox and the reward service replays it on a fresh machine (docs/EXTENDING.md's example)."""

from __future__ import annotations

import pytest
from conftest import open_sandbox

from conveyor.contracts import Task, VerifierSpec
from tasks import environments
from tasks.environments import NeedsMachine, Session, Step, replay

pytestmark = pytest.mark.integration


class ShellGoal:  # reach the state the task's checks describe, one shell command per turn
    machine = True

    def reset(self, task, machine):
        self.machine, self.checks = machine, task.verifier.data["checks"]

    def step(self, action):
        ran = self.machine.run(action)
        if not ran.ok:  # rolled back: the workspace, and so the reward, stay as they were
            return Step(f"exit {ran.exit_code}: {ran.stderr[-200:]}", failed=True)
        met = sum(self.machine.run(check).ok for check in self.checks)
        return Step(f"exit 0\n{ran.stdout[-200:]}", reward=met / len(self.checks), done=met == len(self.checks))


class Raises(ShellGoal):
    def step(self, action):
        self.machine.run(action)
        raise RuntimeError("the environment broke")


CHECKS = ["test -f out.txt", "grep -q hello out.txt"]


@pytest.fixture(scope="module")
def sandbox():
    sb = open_sandbox(timeout_s=5.0, max_output_bytes=1 << 16)
    environments.register("shell_goal", ShellGoal)
    environments.register("raises", Raises)
    yield sb
    environments.unregister("shell_goal")
    environments.unregister("raises")
    sb.close()


def task(env: str = "shell_goal", **data) -> Task:
    data = {"environment": env, "checks": CHECKS, "files": {"notes/a.txt": "keep me\n"}, **data}
    return Task(task_id=f"t-{env}", run_id="r", prompt="Make out.txt say hello.", max_turns=8,
                verifier=VerifierSpec(kind="environment", data=data))  # fmt: skip


def test_the_workspace_persists_and_a_failed_step_is_rolled_back(sandbox):
    s = Session(task(), sandbox)
    try:
        assert s.episode.machine.run("cat notes/a.txt").stdout == "keep me\n"  # the task's files
        assert s.step("echo hi > out.txt").startswith("exit 0")  # one check of two met
        # removes a file, then fails: the whole step is undone
        assert s.step("rm notes/a.txt && echo bye > out.txt && false").startswith("exit 1")
        assert s.episode.machine.run("cat notes/a.txt out.txt").stdout == "keep me\nhi\n"
        assert s.step("echo hello >> out.txt") is None  # both checks met: done
        assert s.done
    finally:
        s.close()


def test_the_reward_service_replays_the_episode_on_a_fresh_machine(sandbox):
    # the third step succeeds only if the failed second one was rolled back (notes/a.txt is back)
    actions = ["echo hi > out.txt", "rm notes/a.txt; exit 3", "test -f notes/a.txt && echo hello >> out.txt"]
    v = replay(task(), actions, sandbox)
    assert (v.reward, v.verdict) == (1.0, "pass")
    half = replay(task(), actions[:2], sandbox)
    assert (half.reward, half.verdict) == (0.5, "fail")
    assert replay(task(), ["exit 1"], sandbox).verdict == "fail"  # a failed step gives no reward


def test_without_a_sandbox_or_with_a_broken_environment_the_verdict_is_an_error(sandbox):
    with pytest.raises(NeedsMachine):
        Session(task())
    v = replay(task(), ["echo hello > out.txt"])
    assert v.verdict == "error" and "needs a machine" in v.feedback.message
    broken = replay(task("raises"), ["echo hello > out.txt"], sandbox)
    assert broken.verdict == "error" and "the environment broke" in broken.feedback.message
    escaped = replay(task(files={"../x": "y"}), ["true"], sandbox)
    assert escaped.verdict == "error" and "outside the workspace" in escaped.feedback.message
    assert environments.needs_machine(task()) and not environments.needs_machine(task("count_to"))


async def test_the_worker_drives_it_on_its_tool_sandbox_and_the_bridge_replays_it(sandbox, tmp_path):
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
    kw = {"prompt": t.prompt, "max_turns": 3, "verifier": t.verifier, "sampling": None}
    worker, rollouts, committed, error = await _pipeline(tmp_path, engine, n_tasks=2, task_kw=kw, tool_sandbox=sandbox)
    assert error is None and rollouts
    assert any(x.role == "tool" and x.text.startswith("exit") for r in rollouts for x in r.turns), "no step ran"
    scored = await RewardBridge(None, None, LocalScorer(sandbox), engine.decode).score(rollouts)
    for r, s in zip(rollouts, scored):
        want = replay(r.task, [x.text for x in r.turns if x.role == "assistant"], sandbox)
        assert (s.reward, s.verdict) == (want.reward, want.verdict)


def test_a_tools_episode_whose_answer_is_code_is_scored_in_the_sandbox(sandbox):
    """The tools environment's answer scored by python_tests in the real sandbox (the reward
    service's path: ``score_batch`` with its sandbox)."""
    import json

    from tasks import tool_env
    from tasks.verifiers import score_batch

    tool_env.register("spec", lambda: "f() must return the number of days in a week")
    tools = [{"name": "spec", "parameters": {"type": "object"}}]
    data = {"environment": "tools", "answer": {"kind": "python_tests", "data": {"tests": "assert f() == 7"}}}
    task = Task(task_id="code", run_id="r", prompt="write f", max_turns=3, tools=tools,
                verifier=VerifierSpec(kind="environment", data=data))  # fmt: skip
    actions = ['<tool_call>{"name": "spec", "arguments": {}}</tool_call>', "```python\ndef f():\n    return 7\n```"]
    try:
        good, bad = score_batch(
            open_sandbox(), [(task, json.dumps(actions)), (task, json.dumps([actions[0], "def f(): return 6"]))]
        )
    finally:
        tool_env.unregister("spec")
    assert (good.reward, good.verdict) == (1.0, "pass") and bad.verdict == "fail"
