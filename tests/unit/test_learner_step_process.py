"""The learner's optimizer steps in a child process (learner/step_process.py) train exactly as in process."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from conveyor.config import LearnerConfig
from conveyor.objectstore import LocalObjectStore
from conveyor.topics import Topics
from conveyor.transport.memory import MemoryTransport
from learner.recipe import GRPOLearner


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from learner.models import create_tiny_llama
    from tasks.suites.pyexpr import ALPHABET

    return create_tiny_llama(tmp_path_factory.mktemp("m"), ALPHABET, seed=0)


def _batch(step: int) -> list:
    """Two groups of four scored rollouts with rewards that differ inside each group."""
    from conveyor.contracts import Rollout, ScoredRollout, Task, VersionSegment, rollout_id

    g = torch.Generator().manual_seed(step)
    groups = []
    for t in range(2):
        task_id = f"s{step}-t{t}"
        task = Task(task_id=task_id, run_id="r", prompt="p", group_size=4)
        prompt = torch.randint(3, 30, (5,), generator=g).tolist()
        group = []
        for i in range(4):
            c = torch.randint(3, 30, (2 + i,), generator=g).tolist()
            group.append(ScoredRollout(rollout=Rollout(
                rollout_id=rollout_id(task_id, i), task_id=task_id, run_id="r", sample_index=i, group_size=4,
                prompt_token_ids=prompt, completion_token_ids=c, behaviour_logprobs=(-torch.rand(len(c), generator=g) - 1).tolist(),
                loss_mask=[1] * len(c), version_segments=[VersionSegment(start=0, end=len(c), policy_version=0)], task=task,
            ), reward=float(i % 2), verdict="pass" if i % 2 else "fail"))  # fmt: skip
        groups.append(group)
    return groups


def _learner(model, tok, tmp_path, ranks=None, **kw) -> GRPOLearner:
    cfg = LearnerConfig(max_lag=100, lr=1e-2, warmup_steps=3, checkpoint_every=0, **kw)
    return GRPOLearner(MemoryTransport(), Topics("r"), copy.deepcopy(model), tok.pad_token_id, LocalObjectStore(tmp_path / "o"),
                       cfg, run_dir=tmp_path, ranks=ranks)  # fmt: skip


def _weights(lrn: GRPOLearner) -> dict:
    return {k: v.detach().clone() for k, v in lrn.model.state_dict().items()}


def test_steps_in_a_child_process_equal_steps_in_process(tiny, tmp_path):
    model, tok = tiny
    here, there = _learner(model, tok, tmp_path / "a"), _learner(model, tok, tmp_path / "b", step_process=True)
    try:
        for step in range(3):
            a, b = here.train_step(_batch(step)), there.train_step(_batch(step))
            for key in ("loss", "grad_norm", "lr", "importance_mean", "clip_fraction", "tokens", "entropy"):
                assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
        wa, wb = _weights(here), _weights(there)
        start = model.state_dict()  # the learners trained copies of it
        assert any(not torch.equal(wa[k], start[k]) for k in wa)  # they trained
        for k in wa:
            torch.testing.assert_close(wb[k], wa[k], rtol=1e-5, atol=1e-6, msg=k)
        # The tied LM head follows the embedding it shares storage with.
        assert there.model.lm_head.weight.data_ptr() == there.model.model.embed_tokens.weight.data_ptr()
    finally:
        there.close()
    with pytest.raises(RuntimeError, match="closed"):
        there.train_step(_batch(9))


def test_a_checkpoint_holds_the_child_optimizer_and_a_resume_continues_it(tiny, tmp_path):
    model, tok = tiny
    first = _learner(model, tok, tmp_path, step_process=True)
    try:
        for step in range(2):
            first.train_step(_batch(step))
        first.version = 2
        asyncio.run(first.checkpoint())
        resumed = _learner(model, tok, tmp_path, step_process=True)
        try:
            assert resumed.resume() and resumed.step == 2
            for k, v in _weights(first).items():
                assert torch.equal(_weights(resumed)[k], v), k
            # The third step needs the child's Adam moments and learning-rate schedule, not fresh ones.
            a, b = first.train_step(_batch(2)), resumed.train_step(_batch(2))
            assert b["lr"] == a["lr"] and b["loss"] == pytest.approx(a["loss"], rel=1e-6)
            wa, wb = _weights(first), _weights(resumed)
            for k in wa:
                torch.testing.assert_close(wb[k], wa[k], rtol=1e-6, atol=1e-7)
        finally:
            resumed.close()
        fresh = _learner(model, tok, tmp_path / "fresh")  # what a resume without the optimizer state would give
        for step in range(2):
            fresh.train_step(_batch(step))
        fresh.trainer.optimizer = torch.optim.AdamW(fresh.model.parameters(), lr=1e-2, weight_decay=0.0)
        fresh.train_step(_batch(2))
        assert any(not torch.allclose(_weights(fresh)[k], wa[k], atol=1e-6) for k in wa)
    finally:
        first.close()


def test_step_process_refuses_several_ranks(tiny, tmp_path):
    from learner.distributed import RankGroup

    model, tok = tiny
    with pytest.raises(ValueError, match="step_process"):
        _learner(model, tok, tmp_path, step_process=True, ranks=RankGroup(0, 2, None))


def test_step_process_refuses_a_model_off_the_cpu(tiny, tmp_path):
    model, tok = tiny
    with pytest.raises(ValueError, match="step_process is for a CPU learner"):
        GRPOLearner(MemoryTransport(), Topics("r"), copy.deepcopy(model).to("meta"), tok.pad_token_id,
                    LocalObjectStore(tmp_path / "o"), LearnerConfig(step_process=True), run_dir=tmp_path)  # fmt: skip


def test_the_learner_service_takes_step_process_from_its_config(monkeypatch, tmp_path):
    """``conveyor serve learner`` builds its learner with the config file's ``learner.step_process``
    and ``learner.updates_per_batch``
    (the service's transport and the learner itself are replaced: only the wiring is under test)."""
    import launch.cli.serve as serve
    import learner.build
    import storage.model_export
    from conveyor.config import load_run_config
    from learner.models import create_tiny_llama
    from tasks.suites.pyexpr import ALPHABET

    create_tiny_llama(tmp_path / "m", ALPHABET, seed=0)
    config = tmp_path / "run.yaml"
    config.write_text("run_id: r\nlearner:\n  step_process: true\n  updates_per_batch: 2\n")
    built = {}
    monkeypatch.setattr(serve, "_load", lambda path, role: load_run_config(path))  # (no logging set-up)
    monkeypatch.setattr(serve, "_run_service", lambda cfg, build: build(None, None, None))
    monkeypatch.setattr(learner.build, "GRPOLearner", lambda *a, **kw: built.update(kw, config=a[5]))
    monkeypatch.setattr(storage.model_export, "store_model_files", lambda *a: [])
    serve.learner(config=config, model=str(tmp_path / "m"), run_dir=tmp_path / "run", threads=0)
    assert built["config"].step_process is True and built["config"].updates_per_batch == 2


def test_several_updates_per_batch_step_the_optimizer_that_often_and_the_schedule_once(tiny, tmp_path):
    model, tok = tiny
    one, two = _learner(model, tok, tmp_path / "one"), _learner(model, tok, tmp_path / "two", updates_per_batch=2)
    a, b = one.train_step(_batch(0)), two.train_step(_batch(0))
    adam_steps = lambda lrn: {float(s["step"]) for s in lrn.trainer.optimizer.state.values()}  # noqa: E731
    assert adam_steps(one) == {1.0} and adam_steps(two) == {2.0}
    assert one.trainer.scheduler.last_epoch == two.trainer.scheduler.last_epoch == 1  # warm-up counts steps, not updates
    # The first update's statistics are the one-update step's; the last update's are beside them.
    for key in ("loss", "importance_mean", "clip_fraction", "grad_norm", "lr"):
        assert b[key] == pytest.approx(a[key], rel=1e-6), key
    assert b["updates"] == 2 and "updates" not in a
    assert b["last_importance_mean"] != pytest.approx(b["importance_mean"])  # the policy moved between the updates
    wa, wb = _weights(one), _weights(two)
    assert any(not torch.allclose(wa[k], wb[k]) for k in wa)
    with pytest.raises(ValueError, match="updates_per_batch"):
        _learner(model, tok, tmp_path / "zero", updates_per_batch=0)


def test_several_updates_per_batch_in_a_child_process_equal_them_in_process(tiny, tmp_path):
    model, tok = tiny
    here = _learner(model, tok, tmp_path / "a", updates_per_batch=3)
    there = _learner(model, tok, tmp_path / "b", updates_per_batch=3, step_process=True)
    try:
        a, b = here.train_step(_batch(0)), there.train_step(_batch(0))
        assert b["updates"] == 3 and b["last_clip_fraction"] == pytest.approx(a["last_clip_fraction"], abs=1e-6)
        wa, wb = _weights(here), _weights(there)
        for k in wa:
            torch.testing.assert_close(wb[k], wa[k], rtol=1e-5, atol=1e-6, msg=k)
    finally:
        there.close()


def test_the_decoupled_objective_keeps_the_steps_proximal_policy_for_every_update(tiny, tmp_path, monkeypatch):
    """The proximal log-probabilities are taken once, before the step's first update (one pass
    without gradient per micro-batch), and the later updates clip around them."""
    import learner.trainer

    model, tok = tiny
    lrn = _learner(model, tok, tmp_path, updates_per_batch=3, micro_batch=3, objective="decoupled")
    calls = {"no_grad": 0, "grad": 0}
    real_logprobs, real_loss = lrn.trainer.logprobs, learner.trainer.clipped_pg_loss
    proximal, current = [], []  # per loss call, in order: update 1's parts, then update 2's, then 3's

    def counted(*a, **k):
        calls["grad" if torch.is_grad_enabled() else "no_grad"] += 1
        return real_logprobs(*a, **k)

    def recorded(new, behaviour, advantages, masks, cfg, prox, *rest):
        proximal.append([p.clone() for p in prox])
        current.append([x.detach().clone() for x in new])
        return real_loss(new, behaviour, advantages, masks, cfg, prox, *rest)

    monkeypatch.setattr(lrn.trainer, "logprobs", counted)
    monkeypatch.setattr(learner.trainer, "clipped_pg_loss", recorded)
    stats = lrn.train_step(_batch(0))
    parts = stats["micro_batches"]
    assert parts > 1
    assert calls == {"no_grad": parts, "grad": 3 * parts}
    assert len(proximal) == 3 * parts
    for update in (1, 2):
        for part in range(parts):
            later, first = proximal[update * parts + part], proximal[part]
            assert all(torch.equal(x, y) for x, y in zip(later, first))  # the step's proximal policy, every update
            # ...which is the policy before the first update: the first update's own log-probabilities,
            # not the moved policy's of the later updates.
            assert all(torch.allclose(x, y, atol=1e-5) for x, y in zip(first, current[part]))
            assert any(not torch.allclose(x, y, atol=1e-5) for x, y in zip(later, current[update * parts + part]))


def test_the_kl_penalty_holds_the_child_to_the_starting_policy_as_in_process(tiny, tmp_path):
    """``kl_coef > 0`` (``conveyor demo --kl-coef``): the child keeps its own frozen copy of the
    policy it started from, so the penalty is the in-process learner's, step for step."""
    model, tok = tiny
    here = _learner(model, tok, tmp_path / "a", kl_coef=0.5)
    there = _learner(model, tok, tmp_path / "b", kl_coef=0.5, step_process=True)
    plain = _learner(model, tok, tmp_path / "c")
    try:
        kls = []
        for step in range(3):
            a, b, c = here.train_step(_batch(step)), there.train_step(_batch(step)), plain.train_step(_batch(step))
            assert b["kl"] == pytest.approx(a["kl"], rel=1e-4, abs=1e-9) and "kl" not in c
            kls.append(a["kl"])
        assert kls[0] == pytest.approx(0.0, abs=1e-9) and kls[2] > 0  # the policy starts at the reference, then moves away
        wa, wb, wc = _weights(here), _weights(there), _weights(plain)
        for k in wa:
            torch.testing.assert_close(wb[k], wa[k], rtol=1e-5, atol=1e-6, msg=k)
        assert any(not torch.allclose(wa[k], wc[k]) for k in wa)  # the penalty changed the updates
    finally:
        there.close()
