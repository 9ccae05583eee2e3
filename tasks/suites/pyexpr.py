"""The demo's task family: finish a Python program so that its assert passes.

Each prompt is the start of a program over a small list, e.g.::

    a = [3, 8, 1, 9]
    assert max(a) ==

and the completion must end the last line (`` 9`` then a newline). The reward
comes from *executing* ``prompt + completion`` in the sandbox: exit status 0
is a pass. Expressions: indexing (``a[0]``..``a[3]``, ``a[-1]``), ``max``
and ``min``; they need lookup and comparison, which a small transformer can
learn, and the space of lists is large enough that the held-out split tests
generalisation, not memory. (Sums of two elements were in the first
version; a 335k-parameter model's arithmetic capped the held-out pass rate
near 0.85 on some seeds.)

The verifier accepts only an integer literal as the completion (a format
check before execution): otherwise ``max(a)`` itself, copied from the
prompt, would pass every assert — and the policy finds that quickly.

The held-out split is a fixed, seed-independent set chosen by hash; it is
never used for warm-up or training.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator
from dataclasses import dataclass

from conveyor.contracts import SamplingParams, Task, VerifierSpec

EXPRESSIONS = ("a[0]", "a[1]", "a[2]", "a[3]", "a[-1]", "max(a)", "min(a)")


@dataclass(frozen=True)
class Problem:
    values: tuple[int, ...]
    expr: str

    @property
    def prompt(self) -> str:
        return f"a = [{', '.join(map(str, self.values))}]\nassert {self.expr} =="

    @property
    def answer(self) -> int:
        return eval(self.expr, {"__builtins__": {"max": max, "min": min}}, {"a": list(self.values)})  # noqa: S307 - our own expressions

    @property
    def completion(self) -> str:
        return f" {self.answer}\n"

    @property
    def key(self) -> str:
        return f"{self.values}|{self.expr}"


ALPHABET = "".join(sorted(set("".join(Problem((0, 1, 2, 3), e).prompt for e in EXPRESSIONS) + "0123456789\n -")))


def is_heldout(p: Problem) -> bool:
    return hashlib.sha256(p.key.encode()).digest()[0] < 13  # ~5 %


def sample_problems(rng: random.Random, heldout: bool = False) -> Iterator[Problem]:
    """An endless stream of problems from one split."""
    while True:
        p = Problem(tuple(rng.randrange(10) for _ in range(4)), rng.choice(EXPRESSIONS))
        if is_heldout(p) == heldout:
            yield p


def heldout_set(n: int) -> list[Problem]:
    """A fixed held-out evaluation set (the same for every seed)."""
    rng = random.Random(1234)
    out: dict[str, Problem] = {}
    stream = sample_problems(rng, heldout=True)
    while len(out) < n:
        p = next(stream)
        out.setdefault(p.key, p)
    return list(out.values())


# The warm-up teacher is wrong in a consistent way on some expressions (it
# confuses min with max, a[-1] with a[0], ...): supervised data with
# systematic errors, which RL against the executed program then corrects.
TEACHER_CONFUSIONS = {
    "min(a)": "max(a)",
    "max(a)": "min(a)",
    "a[-1]": "a[0]",
    "a[2]": "a[1]",
}


def warmup_completion(p: Problem, rng: random.Random, noise: float) -> str:
    """The teacher's completion for ``p``: wrong with probability ``noise`` on confusable expressions."""
    wrong = TEACHER_CONFUSIONS.get(p.expr)
    if wrong is not None and rng.random() < noise:
        return f" {Problem(p.values, wrong).answer}\n"
    return p.completion


def to_task(p: Problem, run_id: str, group_size: int, index: int, split_name: str = "train") -> Task:
    return Task(
        task_id=f"pyexpr-{index:07d}",
        run_id=run_id,
        prompt=p.prompt,
        verifier=VerifierSpec(kind="python_program", data={"suite": "pyexpr", "answer_format": "int_literal"}),
        group_size=group_size,
        sampling=SamplingParams(temperature=1.0, max_tokens=5, stop=["\n"]),
        split=split_name,  # type: ignore[arg-type]
        metadata={"answer": str(p.answer)},
    )
