"""The reward bridge streams verdicts: one slow reward task holds back nothing but itself (and
its partition's commit); a stop that cannot drain in time fails loudly."""

from __future__ import annotations

import asyncio

import pytest

from conveyor.config import BridgeConfig
from conveyor.contracts import ScoredRollout, Task, VerifierSpec
from conveyor.messaging import ServiceClients
from conveyor.metrics import RewardMetrics, make_registry
from conveyor.topics import Topics
from conveyor.transport.memory import MemoryTransport
from reward.bridge import DrainTimeout, RewardBridge
from tasks.verifiers import Verdict

pytestmark = pytest.mark.unit


class HeldScorer:
    """Verdicts at once, except for rollouts of the tasks in ``held``, which wait for ``release``."""

    def __init__(self, held: set[str]) -> None:
        self.held = held
        self.release = asyncio.Event()
        self.submitted: list[str] = []

    def submit(self, items):
        async def one(task, rollout_id):
            self.submitted.append(rollout_id)
            if task.task_id in self.held:
                await self.release.wait()
            return Verdict(1.0, "pass")

        return [asyncio.ensure_future(one(task, rid)) for task, _, rid in items]


async def _setup(n_tasks: int):
    from conftest import make_rollout_for

    topics = Topics("br")
    transport = MemoryTransport(partitions=1)
    await transport.create_topics(topics.specs(1))
    io = ServiceClients(transport, topics.dead_letter, "test")
    await io.__aenter__()
    pub = io.publisher(topics.rollouts)
    for i in range(n_tasks):
        task = Task(task_id=f"t{i}", run_id="br", prompt="p", group_size=1, verifier=VerifierSpec(kind="python_program"))
        r = make_rollout_for(task, "print(1)")
        await (await pub.publish(r, r.task_id))
    return transport, topics, io


async def _scored(io, topics) -> list[str]:
    sub = await io.subscribe([topics.scored], "check", ScoredRollout)
    return [d.message.rollout.task_id for d in await sub.poll(timeout_s=0.3, max_records=1000)]


async def test_a_slow_reward_task_holds_back_only_itself(tmp_path):
    transport, topics, io = await _setup(6)
    scorer = HeldScorer({"t1"})
    registry = make_registry()
    bridge = RewardBridge(transport, topics, scorer, lambda ids: "x", BridgeConfig(max_batch=2),  # three polls' worth
                          metrics=RewardMetrics.create(registry))  # fmt: skip
    stop = asyncio.Event()
    run = asyncio.create_task(bridge.run(stop))
    for _ in range(100):
        if bridge.scored >= 5:
            break
        await asyncio.sleep(0.02)
    assert sorted(await _scored(io, topics)) == ["t0", "t2", "t3", "t4", "t5"]  # all but the held one
    group = transport.broker.groups[topics.group("reward-bridge")]
    assert sum(group.committed.values()) == 1  # committed up to t1, never past it
    assert registry.get_sample_value("conveyor_reward_in_flight_rollouts") == 1  # the held one
    scorer.release.set()
    stop.set()
    await asyncio.wait_for(run, 10)
    assert sum(group.committed.values()) == 6 and bridge.scored == 6
    verdicts = {"kind": "python_program", "verdict": "pass"}
    assert registry.get_sample_value("conveyor_reward_verdicts_total", verdicts) == 6
    assert registry.get_sample_value("conveyor_reward_scoring_seconds_count", {"kind": "python_program"}) == 6
    await io.__aexit__(None, None, None)


async def test_a_stop_that_cannot_drain_in_time_raises(tmp_path):
    transport, topics, io = await _setup(2)
    bridge = RewardBridge(transport, topics, HeldScorer({"t0"}), lambda ids: "x", BridgeConfig(drain_timeout_s=0.5))
    stop = asyncio.Event()
    run = asyncio.create_task(bridge.run(stop))
    await asyncio.sleep(0.5)
    stop.set()
    with pytest.raises(DrainTimeout, match="1 rollouts still unscored"):
        await asyncio.wait_for(run, 10)
    await io.__aexit__(None, None, None)


async def test_verdicts_are_counted_by_kind_a_rollout_without_a_task_too():
    import msgspec
    from conftest import make_rollout_for

    topics = Topics("nk")
    transport = MemoryTransport(partitions=1)
    await transport.create_topics(topics.specs(1))
    io = ServiceClients(transport, topics.dead_letter, "test")
    await io.__aenter__()
    task = Task(task_id="t0", run_id="nk", prompt="p", group_size=1, verifier=VerifierSpec(kind="python_program"))
    taskless = msgspec.structs.replace(make_rollout_for(task, "print(1)"), task=None)
    await (await io.publisher(topics.rollouts).publish(taskless, "t0"))
    registry = make_registry()

    class Judging:  # as the scorers answer a rollout that carries no task
        def submit(self, items):
            return [asyncio.ensure_future(asyncio.sleep(0, Verdict(0.0, "error") if t is None else Verdict(1.0, "pass")))
                    for t, _, _ in items]  # fmt: skip

    bridge = RewardBridge(transport, topics, Judging(), lambda ids: "x", metrics=RewardMetrics.create(registry))
    stop = asyncio.Event()
    stop.set()  # drain what is there
    await asyncio.wait_for(bridge.run(stop), 20)
    assert registry.get_sample_value("conveyor_reward_verdicts_total", {"kind": "none", "verdict": "error"}) == 1
    await io.__aexit__(None, None, None)
