"""``--model`` takes a local directory or a Hub id, resolved through the local Hugging Face cache
(no network here: the cache is populated the way ``huggingface_hub`` lays it out)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conveyor.hf import ModelNotFound, resolve_model
from learner.models import create_tiny_llama

ROOT = Path(__file__).resolve().parents[2]
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def populate_cache(cache: Path, repo_id: str, model_dir: Path) -> Path:
    """A Hub cache entry for ``repo_id`` holding ``model_dir``'s files, as a download leaves it."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    shutil.copytree(model_dir, snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("model") / "m"
    create_tiny_llama(out, "0123456789+-*() =\n", hidden_size=32, layers=1, intermediate_size=64)
    return out


def test_a_directory_is_itself(tiny):
    assert resolve_model(tiny) == tiny
    assert resolve_model(str(tiny)) == tiny


def test_a_hub_id_resolves_through_the_cache_with_the_hub_offline(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    snapshot = populate_cache(tmp_path / "hub", "acme/tiny-llama", tiny)
    assert resolve_model("acme/tiny-llama", cache_dir=tmp_path / "hub") == snapshot


def test_an_id_that_is_not_cached_names_itself_when_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFound, match="acme/absent"):
        resolve_model("acme/absent", cache_dir=tmp_path / "hub")


@pytest.mark.parametrize("name", ["no-such-dir", "./relative/missing", "a/b/c"])
def test_neither_a_directory_nor_an_id(name):
    with pytest.raises(ModelNotFound, match="not a model directory"):
        resolve_model(name)


def test_a_directory_without_a_config_is_refused(tmp_path):
    with pytest.raises(ModelNotFound, match="config.json"):
        resolve_model(tmp_path)


def test_the_services_load_a_hub_id_from_the_cache(tiny, tmp_path):
    """transformers loads what the id resolves to, in a process whose Hub cache is the populated one."""
    populate_cache(tmp_path / "hub", "acme/tiny-llama", tiny)
    code = (
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "from conveyor.hf import resolve_model\n"
        "d = resolve_model('acme/tiny-llama')\n"
        "AutoTokenizer.from_pretrained(d); m = AutoModelForCausalLM.from_pretrained(d)\n"
        "print(m.config.model_type)\n"
    )
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("llama")
