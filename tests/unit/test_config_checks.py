"""Time limits across sections must nest (conveyor/config_checks.py): a Kafka consumer's
``max_poll_interval_ms`` outlasts every wait between polls that the config allows."""

from __future__ import annotations

import pytest

from conveyor.config import parse_run_config
from conveyor.config_checks import longest_wait_between_polls
from conveyor.errors import ConfigError


def test_the_default_kafka_config_outlasts_every_wait_between_polls():
    cfg = parse_run_config({"transport": {"type": "kafka"}})
    assert cfg.transport.max_poll_interval_ms > 1000 * max(longest_wait_between_polls(cfg).values())


@pytest.mark.parametrize(
    "data, names",
    [
        # aiokafka's own default (300 s) is below the reward bridge's 600 s and the sink's hour
        ({"transport": {"type": "kafka", "max_poll_interval_ms": 300_000}}, "sink.give_up_after_s"),
        (
            {"transport": {"type": "kafka", "max_poll_interval_ms": 500_000}, "sink": {"give_up_after_s": 60}},
            "reward.result_timeout_s",
        ),
        (
            {
                "transport": {"type": "kafka", "max_poll_interval_ms": 900_000},
                "reward": {"result_timeout_s": 900},
                "sink": {"give_up_after_s": 60},
            },
            "reward.result_timeout_s",
        ),
    ],
)
def test_a_max_poll_interval_below_a_wait_is_refused_naming_both_fields(data, names):
    with pytest.raises(ConfigError) as err:
        parse_run_config(data, "run.yaml")
    assert "transport.max_poll_interval_ms" in str(err.value) and names in str(err.value)


def test_the_memory_transport_has_no_poll_interval_to_check():
    assert parse_run_config({"sink": {"give_up_after_s": 86_400}}).sink.give_up_after_s == 86_400


def test_shorter_waits_allow_a_shorter_poll_interval():
    cfg = parse_run_config({"transport": {"type": "kafka", "max_poll_interval_ms": 700_000}, "sink": {"give_up_after_s": 600}})
    assert cfg.transport.max_poll_interval_ms == 700_000


def test_redis_redelivery_must_outlast_the_hard_time_limit():
    with pytest.raises(ConfigError, match="celery.visibility_timeout_s"):
        parse_run_config({"celery": {"type": "redis", "visibility_timeout_s": 60}})
