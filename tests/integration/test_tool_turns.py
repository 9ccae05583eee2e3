"""Tool turns in a workspace that persists across an episode's turns (real
bubblewrap sandbox): state carries over, failing calls are rolled back, the
net script replayed by the stateless terminal verifier reproduces the final
state, and the worker records tool episodes with observations masked out."""

from __future__ import annotations

import pytest

from conveyor.contracts import Task, ToolCall, Turn, VerifierSpec, tool_episode_script
from tasks.terminal_tools import ToolEpisode, parse_turn
from tasks.verifiers import score_batch
from tests.conftest import open_sandbox

pytestmark = pytest.mark.integration

CHECKS = """
import os
def test_b_holds_two():
    assert open("/workspace/b.txt").read().strip() == "2"
def test_a_untouched():
    assert open("/workspace/a.txt").read() == "1"
"""


def _task(max_turns: int = 4) -> Task:
    return Task(task_id="tool", run_id="r", prompt="make b.txt hold 2", group_size=2, max_turns=max_turns,
                verifier=VerifierSpec(kind="terminal", data={"files": {"a.txt": "1"}, "checks": CHECKS}))  # fmt: skip


def test_calls_share_a_workspace_and_failures_are_rolled_back():
    sandbox = open_sandbox()
    episode = ToolEpisode(sandbox, _task())
    try:
        obs, kept = episode.call(parse_turn('{"name": "write_file", "arguments": {"path": "b.txt", "content": "1"}}'))
        assert kept and "[exit 0]" in obs
        obs, kept = episode.call(parse_turn("cat b.txt; echo partial > a.txt; false"))
        assert not kept and "[rolled back]" in obs and "[exit 1]" in obs
        obs, kept = episode.call(parse_turn("cat a.txt b.txt"))  # a.txt is back to 1; b.txt persisted
        assert kept and "11" in obs.replace("\n", "")
        obs, kept = episode.call(parse_turn("```sh\necho 2 > b.txt\n```"))
        assert kept
    finally:
        episode.close()
    assert parse_turn("done") is None and parse_turn("  ") is None
    # The net script (kept calls only) replayed from the base by the stateless verifier passes.
    turns = [Turn(role="assistant", text="", tool_calls=[ToolCall(name="shell", arguments={"kept": k, "replay": r})])
             for k, r in [(True, "printf 1 > b.txt"), (False, "echo partial > a.txt; false"), (True, "cat a.txt"),
                          (True, "echo 2 > b.txt")]]  # fmt: skip
    script = tool_episode_script(turns)
    assert "partial" not in script
    (verdict,) = score_batch(sandbox, [(_task(), script)])
    assert verdict.verdict == "pass", verdict
    sandbox.close()


async def test_worker_runs_tool_episodes(tmp_path):
    from learner.models import create_tiny_llama
    from reward.bridge import RewardBridge
    from reward.scorers import LocalScorer
    from rollout_workers.reference_engine import ReferenceEngine
    from tasks.suites.pyexpr import ALPHABET
    from tests.unit.test_rollout_worker import _pipeline

    create_tiny_llama(tmp_path / "m", ALPHABET, seed=3, hidden_size=32, layers=2, heads=2, intermediate_size=64,
                      max_positions=512)  # fmt: skip
    engine = ReferenceEngine(tmp_path / "m", seed=0)
    sandbox = open_sandbox()
    task = _task(max_turns=3)
    worker, rollouts, committed, error = await _pipeline(
        tmp_path, engine, n_tasks=2, tool_sandbox=sandbox,
        task_kw={"max_turns": 3, "verifier": task.verifier, "group_size": 3},
    )  # fmt: skip
    assert error is None and committed == 2 and len(rollouts) == 6
    for r in rollouts:
        roles = [t.role for t in r.turns]
        assert roles[0] == "assistant" and set(roles) <= {"assistant", "tool"}
        assert all(len(t.tool_calls) <= 1 for t in r.turns)
        mask, ids = r.loss_mask.tolist(), r.completion_token_ids.tolist()
        observed = [t for t, m in zip(ids, mask) if m == 0]
        assert observed == [i for t in r.turns if t.role == "tool" for i in engine.encode(t.text)]
        calls = [c for t in r.turns for c in t.tool_calls]
        assert all(isinstance(c.arguments["kept"], bool) and "replay" in c.arguments for c in calls)
    assert any(c for r in rollouts for t in r.turns for c in t.tool_calls), "no episode made a call"
    # The bridge judges a tool episode by its net script: the same verdicts as scoring the scripts.
    bridge = RewardBridge(None, None, LocalScorer(sandbox), engine.decode)
    scored = await bridge.score(rollouts)
    scripts = [tool_episode_script(r.turns) for r in rollouts]
    direct = score_batch(sandbox, [(r.task, s if s is not None else engine.decode(r.completion_token_ids.tolist()))
                                   for r, s in zip(rollouts, scripts)])  # fmt: skip
    assert [s.verdict for s in scored] == [v.verdict for v in direct]
    sandbox.close()
