"""Small Python functions of graded difficulty, checked by unit tests.

Each problem is a signature with a docstring; the model writes the function
(or class) in a ```python block and the ``python_tests`` verifier runs it
against a few ``test_*`` functions in the sandbox (``style: functions``,
``reward: fraction``: the reward is the fraction of tests passed).

The problems are data, in ``python_functions.yaml`` next to this module
(shipped as package data): a signature, a docstring, a reference body and
test cases as ``(call, expected)`` pairs of Python expressions; each case
becomes one ``test_*`` function whose failure message shows the call, what
it returned and what was expected. Class problems add helper code to the
tests (``helpers``) that drives an instance through a list of operations.

``wrong`` is a well-formed but wrong answer (the signature returning
``None``): it must score 0, which also checks that no test passes by
accident. The split is fixed by a hash of the id (about 20 % held out).
"""

from __future__ import annotations

import functools
import textwrap
from dataclasses import dataclass
from importlib import resources

import yaml

from conveyor.contracts import Task, VerifierSpec
from tasks.suites import split_of, suite_task

SUITE = "python_functions"
DATA = "python_functions.yaml"


def _indent(src: str) -> str:
    return textwrap.indent(textwrap.dedent(src).strip("\n"), "    ")


@dataclass(frozen=True)
class Problem:
    id: str
    difficulty: int  # 1 (easy) .. 3 (hard)
    signature: str  # "def f(x: int) -> int:" or "class C:"
    doc: str
    body: str  # the reference implementation's body
    cases: tuple[tuple[str, str], ...]  # (call, expected) Python expressions
    helpers: str = ""  # extra (non-test) code for the tests
    wrong_body: str = "return None"

    @property
    def name(self) -> str:
        return self.signature.split()[1].split("(")[0].rstrip(":")

    @property
    def split(self) -> str:
        return split_of(SUITE, self.id)

    @property
    def stub(self) -> str:
        return f"{self.signature}\n{_indent(chr(34) * 3 + textwrap.dedent(self.doc).strip() + chr(34) * 3)}\n"

    @property
    def reference(self) -> str:
        return f"```python\n{self.signature}\n{_indent(self.body)}\n```\n"

    @property
    def wrong(self) -> str:
        return f"```python\n{self.signature}\n{_indent(self.wrong_body)}\n```\n"

    @property
    def prompt(self) -> str:
        kind = "class" if self.signature.startswith("class") else "function"
        return (
            f"Implement the following Python {kind}. Use only the standard library.\n\n"
            f"```python\n{self.stub}```\n\n"
            f"Reply with the complete {kind} in a ```python code block.\n"
        )

    @property
    def tests(self) -> str:
        parts = [textwrap.dedent(self.helpers).strip() + "\n"] if self.helpers else []
        for n, (call, want) in enumerate(self.cases, 1):
            parts.append(
                f"def test_{self.name.lower()}_{n}():\n"
                f"    got, want = {call}, {want}\n"
                f"    assert got == want, '%s returned %r, expected %r' % ({call!r}, got, want)\n"
            )
        return "\n\n".join(parts)


@functools.cache
def _load() -> tuple[Problem, ...]:
    entries = yaml.safe_load(resources.files(__package__).joinpath(DATA).read_text(encoding="utf-8"))
    return tuple(Problem(**{**e, "cases": tuple(tuple(case) for case in e["cases"])}) for e in entries)


def problems() -> list[Problem]:
    return list(_load())


def to_task(p: Problem, run_id: str, group_size: int, index: int) -> Task:
    data = {"suite": SUITE, "tests": p.tests, "style": "functions", "reward": "fraction"}
    return suite_task(SUITE, p, run_id, group_size, index, prompt=p.prompt, max_tokens=1024,
                      verifier=VerifierSpec(kind="python_tests", data=data))  # fmt: skip
