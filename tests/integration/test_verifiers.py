"""Verifiers through the real sandbox: Python with tests, terminal tasks."""

from __future__ import annotations

import pytest
from conftest import open_sandbox

from conveyor.contracts import Task, VerifierSpec


@pytest.fixture(scope="module")
def sandbox():
    sb = open_sandbox(timeout_s=2.0)
    yield sb
    sb.close()


def T(kind, prompt="p", **data):
    return Task(task_id="t", run_id="r", prompt=prompt, verifier=VerifierSpec(kind=kind, data=data))


def score(sandbox, *items):
    from tasks.verifiers import score_batch

    return score_batch(sandbox, list(items))


ASSERTS = "assert add(1, 2) == 3\nassert add(-1, 1) == 0\nassert add(2, 2) == 4\n"
FUNCTIONS = "def test_small():\n    assert add(1, 2) == 3\n\ndef test_negative():\n    assert add(-1, 1) == 0\n"


@pytest.mark.parametrize("style,tests", [("assert", ASSERTS), ("functions", FUNCTIONS)])
def test_python_tests_all_or_nothing_and_fraction(sandbox, style, tests):
    good = "```python\ndef add(a, b):\n    return a + b\n```"
    half = "def add(a, b):\n    return 3\n"
    g, h, f = score(
        sandbox,
        (T("python_tests", tests=tests, style=style), good),
        (T("python_tests", tests=tests, style=style), half),
        (T("python_tests", tests=tests, style=style, reward="fraction"), half),
    )
    assert (g.reward, g.verdict) == (1.0, "pass")
    assert (h.reward, h.verdict) == (0.0, "fail") and h.feedback.failing_test
    assert f.verdict == "fail" and 0 < f.reward < 1 and f.details["tests_passed"] == 1


def test_python_tests_feedback_points_at_the_models_line(sandbox):
    [v] = score(sandbox, (T("python_tests", tests="def test_it():\n    assert add(1, 2) == 3\n", style="functions"),
                          "def add(a, b):\n    x = None\n    return x + b\n"))  # fmt: skip
    assert v.verdict == "fail"
    assert (v.feedback.exception_type, v.feedback.file, v.feedback.line, v.feedback.failing_test) == (
        "TypeError",
        "solution.py",
        3,
        "test_it",
    )


def test_prepend_prompt(sandbox):
    [v] = score(sandbox, (T("python_tests", prompt="def add(a, b):\n", tests=ASSERTS, prepend_prompt=True), "    return a + b\n"))
    assert v.verdict == "pass"


CHECKS = (
    "import os\n"
    "def test_upper():\n    assert open('/workspace/data/A.txt').read() == 'HELLO\\n'\n"
    "def test_original_removed():\n    assert not os.path.exists('/workspace/data/a.txt')\n"
)


def test_terminal_task_checks_the_resulting_state(sandbox):
    spec = dict(files={"data/a.txt": "hello\n"}, checks=CHECKS, reward="fraction")
    good, partial, broken = score(
        sandbox,
        (T("terminal", **spec), "```sh\ntr a-z A-Z < data/a.txt > data/A.txt\nrm data/a.txt\n```"),
        (T("terminal", **spec), "rm data/a.txt\n"),
        (T("terminal", **spec), "false\n"),
    )
    assert (good.reward, good.verdict) == (1.0, "pass")
    assert (partial.reward, partial.verdict) == (0.5, "fail") and partial.feedback.failing_test == "test_upper"
    assert broken.reward == 0.0 and "exited 1" in broken.feedback.text


def test_terminal_task_on_an_image_leaves_the_image_alone(sandbox, tmp_path, monkeypatch):
    from sandbox.images import normalise_roots

    monkeypatch.setattr(sandbox, "image_roots", normalise_roots([tmp_path]))  # images only from reward.image_roots
    (tmp_path / "keep.txt").write_text("x")
    [v] = score(sandbox, (T("terminal", image=str(tmp_path), checks="import os\nassert not os.path.exists('/workspace/keep.txt')\n",
                            style="assert"), "rm keep.txt\n"))  # fmt: skip
    assert v.verdict == "pass"
    assert (tmp_path / "keep.txt").read_text() == "x"


def test_bad_task_payload_is_an_error_not_a_crash(sandbox):
    a, b, c = score(sandbox, (T("python_tests"), "x"), (T("terminal", checks="x", files={"../../etc/x": "y"}), "true"),
                    (T("unknown_kind"), "x"))  # fmt: skip
    assert all(v.verdict == "error" and v.feedback.message.startswith("bad task") for v in (a, b, c))
