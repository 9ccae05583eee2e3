from __future__ import annotations

from pathlib import Path

import pytest

from conveyor.config import load_run_config, parse_run_config
from conveyor.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted(
    p
    for d in ("examples", "deploy")
    for p in (ROOT / d).rglob("*.yaml")
    if p.read_text().startswith(("run_id", "#")) and "\nrun_id:" in "\n" + p.read_text()
)
# (the Kubernetes ConfigMap embeds a run config too: tests/unit/test_deploy_manifests.py parses that one)


def test_there_are_shipped_configs():
    assert len(SHIPPED) >= 3


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_shipped_config_parses(path):
    cfg = load_run_config(path)
    assert cfg.run_id


@pytest.mark.parametrize(
    "data, field",
    [
        ({"transprt": {}}, "transprt"),
        ({"transport": {"type": "kafka", "partitons": 3}}, "transport.kafka.partitons"),
        ({"transport": {"type": "zmq"}}, "transport"),
        ({"object_store": {"type": "s3", "max_attempts": 0}}, "object_store.s3.max_attempts"),
        ({"celery": {"type": "redis", "url": "amqp://x"}}, "celery.redis.url"),
        ({"run_id": "has space"}, "run_id"),
        ({"transport": {"type": "kafka", "heartbeat_interval_ms": 5000}}, "transport.kafka"),
        ({"rollout": {"engine": "tgi"}}, "rollout.engine"),
        ({"rollout": {"vllm": {"speculative": {"method": "ngram"}}}}, "rollout.vllm.speculative"),
        ({"rollout": {"vllm": {"kv_cache_mb": 1}}}, "rollout.vllm.kv_cache_mb"),
        ({"learner": {"updates_per_batch": 0}}, "learner.updates_per_batch"),
    ],
)
def test_invalid_config_names_the_field(data, field):
    with pytest.raises(ConfigError) as err:
        parse_run_config(data, "test.yaml")
    assert f"  {field}" in str(err.value)
    assert "test.yaml" in str(err.value)


@pytest.mark.parametrize("sampling, field", [({"temperature": 0.7}, "sampling.temperature"), ({"top_p": 0.9}, "sampling.top_p")])
def test_speculative_sampling_is_refused_where_its_logprobs_cannot_be_scored(sampling, field):
    """Under speculation the engine scores each sample with untempered prompt logprobs."""
    spec = {"engine": "vllm", "vllm": {"speculative": {"method": "ngram", "num_speculative_tokens": 3},
                                       "speculative_sampling": "score"}}  # fmt: skip
    with pytest.raises(ConfigError, match=f"{field}: with rollout.vllm.speculative_sampling: score"):
        parse_run_config({"rollout": spec, "sampling": sampling}, "test.yaml")
    assert parse_run_config({"rollout": spec}).rollout.vllm.speculative  # temperature 1, top_p 1
    trusted = {**spec, "vllm": {**spec["vllm"], "speculative_sampling": "trust"}}
    assert parse_run_config({"rollout": trusted, "sampling": sampling}).sampling
    refusing = {**spec, "vllm": {**spec["vllm"], "speculative_sampling": "refuse"}}  # every rollout refused
    with pytest.raises(ConfigError, match="rollout.vllm.speculative_sampling: refuse"):
        parse_run_config({"rollout": refusing})
    assert parse_run_config({"rollout": refusing, "sampling": {"temperature": 0}})  # greedy rollouts


def test_environment_overrides_the_file(monkeypatch):
    monkeypatch.setenv("CONVEYOR_TRANSPORT__BOOTSTRAP_SERVERS", "broker:9092")
    monkeypatch.setenv("CONVEYOR_RUN_ID", "from-env")
    cfg = parse_run_config({"run_id": "from-file", "transport": {"type": "kafka", "partitions": 3}})
    assert cfg.run_id == "from-env"
    assert cfg.transport.bootstrap_servers == "broker:9092"
    assert cfg.transport.partitions == 3


def test_bad_yaml_and_missing_file_are_config_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("run_id: [unclosed")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_run_config(bad)
    with pytest.raises(ConfigError, match="cannot read"):
        load_run_config(tmp_path / "missing.yaml")
    listy = tmp_path / "list.yaml"
    listy.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_run_config(listy)


def test_secrets_are_not_printed():
    cfg = parse_run_config({"object_store": {"type": "s3", "secret_access_key": "hunter2"}})
    assert "hunter2" not in repr(cfg)


def test_overrides_change_only_the_fields_they_name_and_are_checked():
    from conveyor.config import with_overrides

    base = parse_run_config({"run_id": "o", "learner": {"batch_groups": 4, "lr": 0.001}})
    cfg = with_overrides(base, {"learner": {"max_lag": 0}, "run_id": "p"}, "test")
    assert (cfg.run_id, cfg.learner.max_lag, cfg.learner.batch_groups, cfg.learner.lr) == ("p", 0, 4, 0.001)
    with pytest.raises(ConfigError, match="learner.max_lag"):
        with_overrides(base, {"learner": {"max_lag": -1}}, "test")
