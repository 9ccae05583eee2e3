"""`conveyor demo`'s options: its own settings, and the run config's fields (checked where they are
declared); what cannot work is refused before any work starts, with the option or field named."""

import pytest

from conveyor.errors import ConfigError
from launch.demo import DemoConfig, run_demo
from launch.demo_config import demo_run_config


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"eval_every_s": -1.0}, "--eval-every"),
        ({"eval_every_s": 0.0, "target_pass_rate": 0.8}, "--target needs evaluations"),
    ],
)
def test_refused_with_the_option_named(tmp_path, kw, needle):
    with pytest.raises(SystemExit, match=needle):
        run_demo(DemoConfig(out_dir=tmp_path, **kw))
    assert list(tmp_path.iterdir()) == []  # refused before any run directory or object was written


@pytest.mark.parametrize(
    ("run", "field"),
    [
        ({"rollout": {"engine": "tgi"}}, "rollout.engine"),
        ({"learner": {"entropy_coef": -0.01}}, "learner.entropy_coef"),
        ({"learner": {"kl_coef": -0.1}}, "learner.kl_coef"),
        ({"learner": {"updates_per_batch": 0}}, "learner.updates_per_batch"),
        ({"learner": {"objective": "ppo"}}, "learner.objective"),
    ],
)
def test_run_config_fields_are_checked_where_they_are_declared(run, field):
    with pytest.raises(ConfigError, match=field):
        DemoConfig.create(run)


def test_the_cli_refuses_a_bad_field_with_exit_2(monkeypatch, tmp_path):
    from tests.cli import invoke

    result = invoke(monkeypatch, ["demo", "--out", str(tmp_path), "--kl-coef", "-0.1"])
    assert result.exit_code == 2 and "learner.kl_coef" in result.output
    assert list(tmp_path.iterdir()) == []


class _Captured(Exception):
    pass


@pytest.mark.parametrize(
    ("args", "engine_process", "learner_process"),
    [
        ([], True, True),  # the default: both torch loops in child processes
        (["--engine-in-process"], False, True),
        (["--learner-in-process"], True, False),
        (["--engine-in-process", "--learner-in-process"], False, False),
    ],
)
def test_cli_places_the_engine_and_the_learner(monkeypatch, tmp_path, args, engine_process, learner_process):
    from typer.testing import CliRunner

    import conveyor.logging
    import launch.demo
    from launch.cli.main import app

    seen = {}

    def capture(cfg, display=None):
        seen["cfg"] = cfg
        raise _Captured  # the options are what is tested here; the demo itself runs in tests/integration/test_demo.py

    monkeypatch.setattr(launch.demo, "run_demo", capture)
    # The CLI's callback would point structlog and logging at CliRunner's stderr, which is closed
    # after the invocation: later tests' log lines would fail on it.
    monkeypatch.setattr(conveyor.logging, "configure_logging", lambda *a, **kw: None)
    result = CliRunner().invoke(app, ["demo", "--out", str(tmp_path), *args])
    assert isinstance(result.exception, _Captured), result.output
    cfg = seen["cfg"]
    assert (cfg.engine_process, cfg.run.learner.step_process) == (engine_process, learner_process)
    # The CLI's defaults are the demo's run config's
    assert cfg.run.learner.updates_per_batch == demo_run_config().learner.updates_per_batch == 1
    assert cfg.run.learner.kl_coef == demo_run_config().learner.kl_coef == 0.0
    assert cfg.run.learner.max_lag == demo_run_config().learner.max_lag == 3
    if not args:  # no options: every field is the config's default
        assert cfg == launch.demo.DemoConfig(out_dir=tmp_path)


def test_a_run_config_file_sets_the_demos_sections(monkeypatch, tmp_path):
    import launch.demo

    seen = {}

    def capture(cfg, display=None):
        seen["cfg"] = cfg
        raise _Captured

    monkeypatch.setattr(launch.demo, "run_demo", capture)
    run_yaml = tmp_path / "run.yaml"
    run_yaml.write_text("transport: {type: kafka}\nlearner: {lr: 0.001, max_lag: 1}\nsampling: {top_p: 0.9}\n")
    from tests.cli import invoke

    result = invoke(monkeypatch, ["demo", "--config", str(run_yaml), "--max-lag", "2", "--out", str(tmp_path)])
    assert isinstance(result.exception, _Captured), result.output
    run = seen["cfg"].run
    assert (run.learner.lr, run.learner.max_lag, run.sampling.top_p) == (0.001, 2, 0.9)  # the option wins over the file
    assert run.transport.type == "memory" and run.learner.batch_groups == 16  # the demo's own, and its defaults


def test_vision_takes_its_own_defaults_and_refuses_vllm(monkeypatch, tmp_path):
    import launch.demo
    from tests.cli import invoke

    seen = {}

    def capture(cfg, display=None):
        seen["cfg"] = cfg
        raise _Captured

    monkeypatch.setattr(launch.demo, "run_demo", capture)
    result = invoke(monkeypatch, ["demo", "--vision", "--budget", "60", "--out", str(tmp_path)])
    assert isinstance(result.exception, _Captured), result.output
    cfg = seen["cfg"]
    assert cfg == DemoConfig.for_vision(out_dir=tmp_path, rl_budget_s=60.0)  # given options win, the rest are the vision demo's
    assert cfg.vision and cfg.run.producer.suite == "visual" and not cfg.run.learner.step_process
    refused = invoke(monkeypatch, ["demo", "--vision", "--engine", "vllm", "--out", str(tmp_path)])
    assert refused.exit_code == 2 and "torchvision" in refused.output
