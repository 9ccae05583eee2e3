"""LoRA (``learner.lora``): the learner trains an adapter with PEFT and publishes it alone; the
reference engine and ``runs export-model`` merge it into the base model, and sample and score as
the learner's PEFT model does."""

from __future__ import annotations

import asyncio

import pytest
import torch
from pydantic import ValidationError

from conveyor import adapters
from conveyor.config import RunConfig
from conveyor.errors import ConfigError
from tests.lora_checks import logprob_gaps

pytest.importorskip("peft")

LORA = {"rank": 8, "alpha": 16.0}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The demo-size model, its LoRA policy after one optimizer step, and the published blobs."""
    from safetensors.torch import save

    from learner.build import load_policy
    from learner.models import create_tiny_llama
    from learner.packing import packed_completion_logprobs
    from learner.publication import cast
    from learner.trainer import gather_weights
    from tasks.suites.pyexpr import ALPHABET

    base_dir = tmp_path_factory.mktemp("base")
    create_tiny_llama(base_dir, ALPHABET, seed=0, heads=3)  # the demo's model as `--engine vllm` makes it
    policy, tok = load_policy(base_dir, RunConfig(learner={"lora": LORA}))
    frozen = {n: p.detach().clone() for n, p in policy.named_parameters() if not p.requires_grad}
    opt = torch.optim.AdamW(policy.parameters(), lr=5e-2)
    prompts = [tok("a = 1\nassert a ==", add_special_tokens=False).input_ids] * 2
    completions = [tok(" 1\n", add_special_tokens=False).input_ids, tok(" 2\n", add_special_tokens=False).input_ids]
    for _ in range(3):  # B starts at zero: two steps make the adapter change the model
        lp = packed_completion_logprobs(policy, prompts, completions)
        loss = -(lp[0].sum() - lp[1].sum())
        opt.zero_grad()
        loss.backward()
        opt.step()
    policy.eval()
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]  # LoraConfig's default
    adapter = save(cast(gather_weights(policy), "float32"), metadata=adapters.metadata(8, 16.0, targets))  # as published
    full = (base_dir / "model.safetensors").read_bytes()
    return {"base": base_dir, "policy": policy, "tok": tok, "frozen": frozen, "adapter": adapter, "full": full}


def test_only_the_adapter_trains_and_is_published(trained):
    policy, adapter = trained["policy"], trained["adapter"]
    trainable = [n for n, p in policy.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    for n, p in policy.named_parameters():
        if n in trained["frozen"]:
            assert torch.equal(p, trained["frozen"][n]), n  # the base model's weights never move
    from safetensors.torch import load

    tensors = load(adapter)
    assert tensors and all(k.startswith(adapters.PREFIX) and (".lora_A." in k or ".lora_B." in k) for k in tensors)
    assert adapters.adapter_config(adapter) == {
        "rank": 8,
        "alpha": 16.0,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
    }
    assert adapters.adapter_config(trained["full"]) is None
    ratio = len(adapter) / len(trained["full"])
    print(f"FIGURE lora_bytes_ratio {ratio:.3f}")
    params = sum(t.numel() for t in tensors.values())
    assert len(adapter) < params * 4 + 8192  # the adapter's float32 tensors and a header, nothing else


def test_the_reference_engine_merges_a_version_and_samples_like_the_peft_model(trained):
    from rollout_workers.engine import BatchingEngine, SamplingRequest
    from rollout_workers.reference_engine import ReferenceEngine

    policy, tok = trained["policy"], trained["tok"]
    prompts = [tok(t, add_special_tokens=False).input_ids for t in ("a = 1\nassert a ==", "b = [2]\nassert b[0] ==")]

    async def sample():
        engine = BatchingEngine(ReferenceEngine(trained["base"], seed=0))
        try:
            before = await asyncio.gather(*(engine.generate(SamplingRequest(p, n=4, max_tokens=6)) for p in prompts))
            await engine.swap(trained["adapter"], 1)
            after = await asyncio.gather(*(engine.generate(SamplingRequest(p, n=4, max_tokens=6)) for p in prompts))
            return engine.version, before, after
        finally:
            await engine.close()

    version, before, after = asyncio.run(sample())
    assert version == 1
    rows = [(p, c) for p, g in zip(prompts, after) for c in g]
    diff, moved = logprob_gaps(policy, rows)
    assert diff < 1e-4 and moved > 1e-2, (diff, moved)  # the adapter's model, not the base's
    assert all(c.policy_version == 1 for _, c in rows) and all(c.policy_version == 0 for g in before for c in g)


def test_an_adapter_that_does_not_fit_is_refused(trained, tmp_path):
    from safetensors.torch import load, save

    from learner.models import create_tiny_llama
    from rollout_workers.engine import BatchingEngine, WeightsRejected
    from rollout_workers.reference_engine import ReferenceEngine
    from tasks.suites.pyexpr import ALPHABET

    create_tiny_llama(tmp_path / "wide", ALPHABET, seed=0, heads=4, hidden_size=128)  # another shape

    async def swap(engine_dir, blob):
        engine = BatchingEngine(ReferenceEngine(engine_dir, seed=0))
        try:
            await engine.swap(blob, 1)
        finally:
            await engine.close()

    with pytest.raises(WeightsRejected, match="does not fit"):
        asyncio.run(swap(tmp_path / "wide", trained["adapter"]))
    renamed = {k.replace("q_proj", "nope_proj"): v for k, v in load(trained["adapter"]).items()}
    with pytest.raises(WeightsRejected, match="no module"):
        asyncio.run(swap(trained["base"], save(renamed, metadata=adapters.metadata(8, 16.0, ["nope_proj"]))))


def test_export_merges_the_adapter_into_a_complete_model(trained, tmp_path):
    from transformers import AutoModelForCausalLM

    from learner.packing import packed_completion_logprobs
    from storage.model_export import ExportError, _merge_if_adapter

    weights = tmp_path / "model.safetensors"
    weights.write_bytes(trained["adapter"])
    with pytest.raises(ExportError, match="pass the model it started from"):
        _merge_if_adapter(weights, None, "r", 3)
    _merge_if_adapter(weights, trained["base"], "r", 3)
    for name in ("config.json", "generation_config.json"):
        if (trained["base"] / name).is_file():
            (tmp_path / name).write_bytes((trained["base"] / name).read_bytes())
    exported = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    tok = trained["tok"]
    prompts, completions = (
        [tok("a = 1\nassert a ==", add_special_tokens=False).input_ids],
        [tok(" 1\n", add_special_tokens=False).input_ids],
    )
    with torch.no_grad():
        a = packed_completion_logprobs(exported, prompts, completions)[0]
        b = packed_completion_logprobs(trained["policy"], prompts, completions)[0]
    assert torch.allclose(a, b, atol=1e-5)


def test_lora_is_refused_where_it_cannot_train(tmp_path):
    from learner.build import load_policy
    from learner.models import create_tiny_llama
    from tasks.suites.pyexpr import ALPHABET

    with pytest.raises(ValidationError, match="learner.lora trains on one learner process"):
        RunConfig(learner={"lora": LORA, "context_parallel": 2, "pack_tokens": 64})
    create_tiny_llama(tmp_path / "m", ALPHABET, seed=0)
    with pytest.raises(ConfigError, match=r"learner.lora.target_modules: \['w_q'\]"):
        load_policy(tmp_path / "m", RunConfig(learner={"lora": {**LORA, "target_modules": ["q_proj", "w_q"]}}))
    with pytest.raises(ConfigError, match="learner.lora: adapters train on one learner process"):
        load_policy(tmp_path / "m", RunConfig(learner={"lora": LORA}), ranks=object())


def test_the_kl_reference_of_a_lora_policy_is_its_base_model_without_a_copy(trained, tmp_path):
    """``kl_coef > 0`` with ``learner.lora``: the reference is the policy with its adapter off (its
    start: B starts at zero), not a second copy of the model; the penalty equals a frozen copy's."""
    import copy

    from learner.build import load_policy
    from learner.trainer import Trainer
    from tests.unit.test_learner_step_process import _batch, _learner

    policy, tok = load_policy(trained["base"], RunConfig(learner={"lora": LORA}))
    lean = _learner(policy, tok, tmp_path / "a", kl_coef=0.5, lora=LORA)
    copied = _learner(policy, tok, tmp_path / "b", kl_coef=0.5, lora=LORA)
    assert isinstance(lean.trainer, Trainer) and lean.trainer.reference is None
    copied.trainer.reference = copy.deepcopy(copied.model).eval()  # how a full model's reference is kept
    kls = []
    for step in range(3):
        a, b = lean.train_step(_batch(step)), copied.train_step(_batch(step))
        assert a["kl"] == pytest.approx(b["kl"], rel=1e-4, abs=1e-9) and a["loss"] == pytest.approx(b["loss"], rel=1e-4)
        kls.append(a["kl"])
    assert kls[0] == pytest.approx(0.0, abs=1e-9) and kls[2] > 0  # starts at the reference, then moves away
    assert any(".lora_B." in n and p.abs().sum() > 0 for n, p in lean.model.named_parameters())  # the adapter is on again
