"""The learner publishes weights every ``publish_every`` steps and at a clean stop, announces
each version on the weights topic, and keeps only the newest ``keep_versions`` in the store."""

from __future__ import annotations

import asyncio

import pytest
import torch
from scored_factory import scored_group

from conveyor.config import LearnerConfig
from conveyor.contracts import WeightsAnnouncement, decode
from conveyor.messaging import Publisher
from conveyor.objectstore import LocalObjectStore
from conveyor.topics import Topics
from conveyor.transport.memory import MemoryTransport
from learner.recipe import GRPOLearner


async def _train_groups(transport, topics, learner, run_id: str, groups: int) -> None:
    """Publish ``groups`` scored groups of two, run the learner until it trained them all (one
    group per step), then stop it cleanly."""
    producer = transport.producer()
    await producer.start()
    pub = Publisher(producer, topics.scored)
    for g in range(groups):
        for r in scored_group(run_id, g, 2):
            await (await pub.publish(r, r.rollout.task_id))
    stop = asyncio.Event()
    run = asyncio.create_task(learner.run(stop))
    for _ in range(600):
        if learner.step >= groups:
            break
        await asyncio.sleep(0.05)
    stop.set()
    await asyncio.wait_for(run, 60)
    await producer.close()


async def test_publishes_every_k_steps_and_the_final_policy(tmp_path):
    from learner.models import create_tiny_llama
    from tasks.suites.pyexpr import ALPHABET

    model, tok = create_tiny_llama(tmp_path / "m", ALPHABET, seed=0)
    transport, topics = MemoryTransport(), Topics("pub")
    await transport.create_topics(topics.specs(1))
    store = LocalObjectStore(tmp_path / "objects")
    cfg = LearnerConfig(batch_groups=1, max_lag=100, lr=3e-4, checkpoint_every=0, publish_every=2, keep_versions=2)
    learner = GRPOLearner(transport, topics, model, tok.pad_token_id, store, cfg, run_dir=tmp_path)
    await _train_groups(transport, topics, learner, "pub", 5)  # five steps of one group each
    announced = []
    sub = transport.consumer([topics.weights], "check")
    await sub.start()
    for rec in await sub.getmany(timeout_s=0.5, max_records=100):
        announced.append(decode(rec.value, WeightsAnnouncement).version)
    await sub.close()
    assert learner.step == 5
    assert announced == [2, 4, 5]  # every second step, then the final policy at the stop
    assert learner.publication.versions() == [4, 5]  # keep_versions=2


def test_a_lag_that_would_drop_every_sample_is_refused():
    from conveyor.config import parse_run_config
    from conveyor.errors import ConfigError

    with pytest.raises(ConfigError, match="max_lag"):
        parse_run_config({"learner": {"publish_every": 4, "max_lag": 2}}, "run.yaml")
    parse_run_config({"learner": {"publish_every": 4, "max_lag": 3}}, "run.yaml")


class _SlowWeightsStore(LocalObjectStore):
    """Stores weights slowly, so a step's publication is still in flight when the next step runs."""

    def __init__(self, root, log: list) -> None:
        super().__init__(root)
        self.log = log

    def put(self, key, data, **kw):
        if "/weights/" in key:
            import time

            time.sleep(0.3)
            self.log.append(("stored", key))
        return super().put(key, data, **kw)


async def test_publication_overlaps_the_next_step_and_stays_in_order(tmp_path, monkeypatch):
    """The next step trains while a version is stored and announced; the stored weights are
    still those of their own step, versions are announced in order, and a step's progress
    report (which admits the next batch of rollouts) comes only after its weights."""
    import torch
    from safetensors.torch import load

    from learner.models import create_tiny_llama
    from tasks.suites.pyexpr import ALPHABET

    model, tok = create_tiny_llama(tmp_path / "m", ALPHABET, seed=0)
    transport, topics = MemoryTransport(), Topics("overlap")
    await transport.create_topics(topics.specs(1))
    events: list = []
    store = _SlowWeightsStore(tmp_path / "objects", events)
    cfg = LearnerConfig(batch_groups=1, max_lag=100, lr=3e-4, checkpoint_every=0, keep_versions=10)
    learner = GRPOLearner(transport, topics, model, tok.pad_token_id, store, cfg, run_dir=tmp_path)
    after_step: dict[int, dict] = {}
    train = learner.train_step

    def recorded(batch):
        events.append(("step-start", learner.step + 1))
        stats = train(batch)
        after_step[learner.step] = {k: v.detach().clone() for k, v in learner.trainer.weights().items()}
        return stats

    monkeypatch.setattr(learner, "train_step", recorded)
    sent = Publisher.publish_and_wait

    async def logged(self, msg, key=None):
        events.append((type(msg).__name__, getattr(msg, "version", None) or getattr(msg, "policy_version", None)))
        return await sent(self, msg, key)

    monkeypatch.setattr(Publisher, "publish_and_wait", logged)
    await _train_groups(transport, topics, learner, "overlap", 4)
    assert learner.step == 4 and learner.published_version == 4
    # Overlap: step 2 started before version 1 was stored.
    assert events.index(("step-start", 2)) < events.index(("stored", "runs/overlap/weights/v000001/model.safetensors"))
    announced = [v for kind, v in events if kind == "WeightsAnnouncement"]
    assert announced == [1, 2, 3, 4]
    for v in range(1, 5):
        assert events.index(("WeightsAnnouncement", v)) < events.index(("LearnerProgress", v))
        stored = load(store.get(f"runs/overlap/weights/v{v:06d}/model.safetensors"))
        assert stored.keys() == after_step[v].keys()
        assert all(torch.equal(stored[k], after_step[v][k]) for k in stored)
    assert not all(torch.equal(after_step[1][k], after_step[2][k]) for k in after_step[1])  # steps do change the weights


async def test_weights_are_published_in_the_configured_dtype_and_the_engine_loads_them(tmp_path):
    import torch
    from safetensors.torch import load

    from conveyor import keys
    from learner.models import create_tiny_llama
    from learner.publication import publish_dtype
    from rollout_workers.reference_engine import ReferenceEngine
    from tasks.suites.pyexpr import ALPHABET

    assert (publish_dtype("auto", on_gpu=True), publish_dtype("auto", on_gpu=False)) == ("bfloat16", "float32")
    assert publish_dtype("float16", on_gpu=False) == "float16"
    model, tok = create_tiny_llama(tmp_path / "m", ALPHABET, seed=0)
    transport, topics = MemoryTransport(), Topics("bf16")
    await transport.create_topics(topics.specs(1))
    store = LocalObjectStore(tmp_path / "objects")
    cfg = LearnerConfig(batch_groups=1, max_lag=100, lr=3e-4, checkpoint_every=0, publish_dtype="bfloat16")
    learner = GRPOLearner(transport, topics, model, tok.pad_token_id, store, cfg, run_dir=tmp_path)
    await _train_groups(transport, topics, learner, "bf16", 1)
    data = store.get(keys.weights_key("bf16", 1))
    published = load(data)
    assert {t.dtype for t in published.values()} == {torch.bfloat16}
    assert len(data) < sum(p.numel() for p in model.parameters()) * 4 * 0.6  # about half of fp32's bytes
    engine = ReferenceEngine(tmp_path / "m", seed=0)
    engine.load_weights(data, 1)  # the fp32 engine takes them, cast on copy
    trained = model.state_dict()["model.embed_tokens.weight"]
    served = engine.model.state_dict()["model.embed_tokens.weight"]
    torch.testing.assert_close(served, trained.to(torch.bfloat16).float())


@pytest.mark.parametrize("step_process", [False, True], ids=["in-process", "step-process"])
async def test_a_lora_learner_publishes_adapters_and_checkpoints_resume_them(tmp_path, step_process):
    """With ``learner.lora`` every version is the adapter alone (conveyor/adapters.py), from the
    learner's process or its step process, and a checkpoint of the PEFT policy resumes."""
    pytest.importorskip("peft")
    from safetensors.torch import load

    from conveyor import adapters, keys
    from conveyor.config import RunConfig
    from learner.build import load_policy
    from learner.models import create_tiny_llama
    from tasks.suites.pyexpr import ALPHABET

    create_tiny_llama(tmp_path / "m", ALPHABET, seed=0)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    run = RunConfig(learner={"lora": {"rank": 4, "alpha": 8}, "batch_groups": 1, "max_lag": 100, "lr": 1e-2,
                             "checkpoint_every": 2, "step_process": step_process})  # fmt: skip
    transport, topics = MemoryTransport(), Topics("lora")
    await transport.create_topics(topics.specs(1))
    store = LocalObjectStore(tmp_path / "objects")
    model, tok = load_policy(tmp_path / "m", run)
    learner = GRPOLearner(transport, topics, model, tok.pad_token_id, store, run.learner, run_dir=tmp_path / "a")
    await _train_groups(transport, topics, learner, "lora", 3)
    blob = store.get(keys.weights_key("lora", learner.publication.version))
    assert adapters.adapter_config(blob) == {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
    tensors = load(blob)
    assert tensors and all(".lora_A." in k or ".lora_B." in k for k in tensors)
    assert any(float(t.abs().max()) > 0 for k, t in tensors.items() if ".lora_B." in k)  # trained: B moved off zero
    # A new learner process on the same run resumes from the checkpoint of the PEFT policy.
    model2, _ = load_policy(tmp_path / "m", run)
    again = GRPOLearner(transport, topics, model2, tok.pad_token_id, store, run.learner, run_dir=tmp_path / "b")
    await _train_groups(transport, topics, again, "lora", 0)
    assert again.resumed_from == learner.step == 3  # the checkpoint at the clean stop
    from learner.trainer import gather_weights

    resumed = gather_weights(model2)  # the restored adapter is the one last published
    assert set(resumed) == set(tensors) and all(torch.equal(resumed[k], tensors[k]) for k in tensors)
