"""`conveyor demo` refuses option combinations that cannot work, before any work starts."""

import pytest

from launch.demo import DemoConfig, run_demo


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"eval_every_s": -1.0}, "--eval-every"),
        ({"eval_every_s": 0.0, "target_pass_rate": 0.8}, "--target needs evaluations"),
        ({"engine": "tgi"}, "--engine tgi"),
        ({"entropy_coef": -0.01}, "--entropy-coef -0.01"),
        ({"kl_coef": -0.1}, "--kl-coef -0.1"),
        ({"updates_per_batch": 0}, "--updates-per-batch 0"),
    ],
)
def test_refused_with_the_option_named(tmp_path, kw, needle):
    with pytest.raises(SystemExit, match=needle):
        run_demo(DemoConfig(out_dir=tmp_path, **kw))
    assert list(tmp_path.iterdir()) == []  # refused before any run directory or object was written


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
    assert (seen["cfg"].engine_process, seen["cfg"].learner_process) == (engine_process, learner_process)
    assert seen["cfg"].updates_per_batch == launch.demo.DemoConfig.updates_per_batch == 1  # the CLI's default is the demo's
    assert seen["cfg"].kl_coef == launch.demo.DemoConfig.kl_coef == 0.0
    assert seen["cfg"].max_lag == launch.demo.DemoConfig.max_lag == 3
    if not args:  # no options: every field is the config's default
        assert seen["cfg"] == launch.demo.DemoConfig(out_dir=tmp_path)
