"""A published policy version exports as a model directory transformers loads, with the run's
tokenizer and chat template, computing what the published weights compute."""

from __future__ import annotations

import pytest
import torch

from conveyor import keys
from conveyor.objectstore import LocalObjectStore
from storage.model_export import STAGES, ExportError, export_model, store_model_files
from tests.chat_models import create_tiny_qwen2_chat
from tests.cli import invoke


def publish(store, run_id: str, version: int, model) -> None:
    """As the learner publishes a version: the checkpoint's tensors, a tied LM head once."""
    from safetensors.torch import save

    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    store.put(keys.weights_key(run_id, version), save(state))


@pytest.fixture
def trained(tmp_path):
    """A run with versions 1 and 2 published; version 2's weights differ from the start's."""
    from transformers import AutoModelForCausalLM

    base = create_tiny_qwen2_chat(tmp_path / "base")
    store = LocalObjectStore(tmp_path / "objects")
    model = AutoModelForCausalLM.from_pretrained(base)
    publish(store, "r1", 1, model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    publish(store, "r1", 2, model)
    return base, store, model


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits


def test_the_newest_version_exports_with_the_stored_model_files(trained, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base, store, model = trained
    assert "tokenizer.json" in store_model_files(store, "r1", base)
    stages = []
    written = export_model(store, "r1", tmp_path / "out", on_stage=lambda n, status: stages.append(status))  # the run's own files
    assert written["version"] == 2 and "model.safetensors" in written["files"]
    assert len(stages) == STAGES and stages[1] == "weights v2 fetched"  # what the CLI's progress bar shows
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    tok = AutoTokenizer.from_pretrained(tmp_path / "out")
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 12 + 30?"}], add_generation_prompt=True, tokenize=False)
    ids = tok(ids, add_special_tokens=False).input_ids
    assert torch.equal(logits(exported, ids), logits(model, ids))
    assert tok.chat_template == AutoTokenizer.from_pretrained(base).chat_template


def test_an_older_version_in_bfloat16_from_the_base_models_files(trained, tmp_path):
    from transformers import AutoModelForCausalLM

    base, store, _ = trained
    written = export_model(store, "r1", tmp_path / "out", version=1, base=base, dtype="bfloat16")
    assert written == {**written, "version": 1, "dtype": "bfloat16"}
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype="auto")
    start = AutoModelForCausalLM.from_pretrained(base)
    assert exported.dtype == torch.bfloat16
    ids = [3, 17, 40, 5]
    torch.testing.assert_close(logits(exported, ids).float(), logits(start, ids), atol=0.05, rtol=0.05)


def test_what_cannot_be_exported_says_why(trained, tmp_path):
    base, store, _ = trained
    with pytest.raises(ExportError, match="no version 7"):
        export_model(store, "r1", tmp_path / "a", version=7, base=base)
    with pytest.raises(ExportError, match="no published weights"):
        export_model(store, "other", tmp_path / "b", base=base)
    with pytest.raises(ExportError, match="stored no model config"):
        export_model(store, "r1", tmp_path / "c")  # neither stored files nor a base
    with pytest.raises(ExportError, match="dtype"):
        export_model(store, "r1", tmp_path / "d", base=base, dtype="int3")


def test_the_command_exports_and_refuses_with_exit_2(monkeypatch, trained, tmp_path):

    base, store, _ = trained
    cli = ["runs", "export-model", "r1", str(tmp_path / "out"), "--store", str(tmp_path / "objects")]
    ok = invoke(monkeypatch, [*cli, "--base-model", str(base), "--version", "1"])
    assert ok.exit_code == 0, ok.output
    assert '"version": 1' in ok.output and (tmp_path / "out" / "config.json").is_file()
    refused = invoke(monkeypatch, [*cli, "--version", "9", "--base-model", str(base)])
    assert refused.exit_code == 2 and "no version 9" in refused.output
