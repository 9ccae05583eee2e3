"""Multi-turn self-correction through the rollout worker, with real execution
feedback from the bubblewrap sandbox: observations spliced in with loss mask
0, every attempt kept as a turn, episodes stop when an attempt passes, and
the bridge judges the last attempt."""

from __future__ import annotations

import pytest

from conveyor.contracts import Feedback
from learner.models import create_tiny_llama
from reward.bridge import RewardBridge
from reward.scorers import LocalScorer
from rollout_workers.multiturn import feedback_text
from rollout_workers.reference_engine import ReferenceEngine
from tasks.suites.pyexpr import ALPHABET
from tests.conftest import open_sandbox
from tests.unit.test_rollout_worker import _pipeline

pytestmark = pytest.mark.integration


def test_feedback_names_the_failure():
    text = feedback_text("fail", Feedback(exception_type="AssertionError", message="3 != 4", line=2, failing_test="test_add"))
    assert "AssertionError: 3 != 4" in text and "line 2" in text and "test_add" in text and text.endswith("try again\n")


async def test_episodes_feed_execution_feedback_back(tmp_path):
    create_tiny_llama(tmp_path / "m", ALPHABET, seed=3, hidden_size=32, layers=2, heads=2, intermediate_size=64,
                      max_positions=256)  # fmt: skip
    engine = ReferenceEngine(tmp_path / "m", seed=0)
    sandbox = open_sandbox()
    scorer = LocalScorer(sandbox)
    worker, rollouts, committed, error = await _pipeline(tmp_path, engine, n_tasks=4, scorer=scorer, task_kw={"max_turns": 3})
    assert error is None and committed == 4 and len(rollouts) == 12
    verdicts = await scorer.score([(r.task, t.text, r.rollout_id) for r in rollouts for t in r.turns if t.role == "assistant"])
    retried = 0
    for r in rollouts:
        ids, mask, logps = r.completion_token_ids.tolist(), r.loss_mask.tolist(), r.behaviour_logprobs.tolist()
        roles = [t.role for t in r.turns]
        attempts = roles.count("assistant")
        assert 1 <= attempts <= 3 and roles == ["assistant", "user"] * (attempts - 1) + ["assistant"]
        retried += attempts > 1
        # Observation tokens: mask 0, logprob 0, and they decode to the feedback turns.
        observed = [t for t, m in zip(ids, mask) if m == 0]
        # (the demo model's character vocabulary maps letters it lacks to <unk>)
        assert observed == [i for t in r.turns if t.role == "user" for i in engine.encode(t.text)]
        assert all(lp == 0.0 for lp, m in zip(logps, mask) if m == 0)
        assert engine.decode([t for t, m in zip(ids, mask) if m == 1]) == "".join(
            t.text for t in r.turns if t.role == "assistant"
        )
        segs = r.version_segments
        assert segs[0].start == 0 and segs[-1].end == len(ids)
        assert all(a.end == b.start for a, b in zip(segs, segs[1:]))
    assert retried > 0, "no episode needed a second attempt: the test shows nothing"
    # An episode continues only after a failing attempt: all attempts but the last failed.
    k = 0
    for r in rollouts:
        n = sum(t.role == "assistant" for t in r.turns)
        assert all(v.verdict != "pass" for v in verdicts[k : k + n - 1])
        k += n
    # The bridge judges the last attempt, not the spliced transcript.
    bridge = RewardBridge(None, None, scorer, engine.decode)
    scored = await bridge.score(rollouts)
    last = [
        verdicts[sum(sum(t.role == "assistant" for t in q.turns) for q in rollouts[: i + 1]) - 1] for i in range(len(rollouts))
    ]
    assert [s.verdict for s in scored] == [v.verdict for v in last]
    sandbox.close()
