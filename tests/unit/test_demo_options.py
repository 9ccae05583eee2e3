"""`conveyor demo` refuses option combinations that cannot work, before any work starts."""

import pytest

from conveyor.demo import DemoConfig, run_demo


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"eval_every_s": -1.0}, "--eval-every"),
        ({"eval_every_s": 0.0, "target_pass_rate": 0.8}, "--target needs evaluations"),
        ({"engine": "tgi"}, "--engine tgi"),
        ({"entropy_coef": -0.01}, "--entropy-coef -0.01"),
    ],
)
def test_refused_with_the_option_named(tmp_path, kw, needle):
    with pytest.raises(SystemExit, match=needle):
        run_demo(DemoConfig(out_dir=tmp_path, **kw))
    assert list(tmp_path.iterdir()) == []  # refused before any run directory or object was written
