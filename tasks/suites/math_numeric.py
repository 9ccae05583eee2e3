"""Arithmetic and algebra word problems with exact numeric answers.

Each template draws its numbers from a ``random.Random`` seeded with
``(seed, template, k)``, so the suite is the same on every machine for a
given seed, and computes the answer with ``Fraction`` (exact; printed as an
integer, a terminating decimal, or ``p/q``). The ``math`` verifier compares
the model's ``\\boxed{...}`` (or last number) with ``answer``.

``reference`` is a short worked solution ending in ``\\boxed{answer}``;
``wrong`` boxes ``answer + 1``. The split is fixed by a hash of the id
(about 20 % held out).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction

from conveyor.contracts import Task, VerifierSpec
from tasks.suites import split_of, suite_task

SUITE = "math_numeric"
SEED = 8


def fmt(x: Fraction | int) -> str:
    """An exact number as text: integer, terminating decimal, or p/q."""
    x = Fraction(x)
    if x.denominator == 1:
        return str(x.numerator)
    d = x.denominator
    for p in (2, 5):
        while d % p == 0:
            d //= p
    if d != 1:
        return f"{x.numerator}/{x.denominator}"
    return format(Decimal(x.numerator) / Decimal(x.denominator), "f").rstrip("0")  # exact: it terminates


@dataclass(frozen=True)
class Problem:
    id: str
    difficulty: int  # 1 (easy) .. 3 (hard)
    question: str
    steps: str  # the worked solution, without the final box
    value: Fraction

    @property
    def answer(self) -> str:
        return fmt(self.value)

    @property
    def split(self) -> str:
        return split_of(SUITE, self.id)

    @property
    def reference(self) -> str:
        return f"{self.steps} So the answer is \\boxed{{{self.answer}}}."

    @property
    def wrong(self) -> str:
        return f"The answer is \\boxed{{{fmt(self.value + 1)}}}."

    @property
    def prompt(self) -> str:
        return f"{self.question}\n\nGive the final answer as a number in \\boxed{{}}.\n"


# Each template: rng -> (question, worked steps, exact answer).
Template = Callable[[random.Random], tuple[str, str, Fraction]]


def shopping(r: random.Random):
    a, b, n, m = r.randint(2, 9), r.randint(3, 15), r.randint(2, 12), r.randint(2, 6)
    return (
        f"A pen costs ${a} and a notebook costs ${b}. How many dollars do {n} pens and {m} notebooks cost together?",
        f"{n}*{a} + {m}*{b} = {n * a} + {m * b} = {n * a + m * b}.",
        Fraction(n * a + m * b),
    )


def discount(r: random.Random):
    price, pct = 20 * r.randint(2, 20), 5 * r.randint(1, 12)
    off = Fraction(price * pct, 100)
    return (
        f"A jacket costs ${price}. It is on sale for {pct}% off. What is the sale price in dollars?",
        f"The discount is {pct}% of {price} = {fmt(off)}, and {price} - {fmt(off)} = {fmt(price - off)}.",
        price - off,
    )


def rectangle(r: random.Random):
    length, width = r.randint(5, 30), r.randint(2, 20)
    per = 2 * (length + width)
    return (
        f"A rectangle has a perimeter of {per} cm and a length of {length} cm. What is its area in square centimetres?",
        f"The width is {per}/2 - {length} = {width}, so the area is {length}*{width} = {length * width}.",
        Fraction(length * width),
    )


def travel(r: random.Random):
    v, t, w, s = r.randint(40, 120), r.randint(1, 4), r.randint(30, 90), r.randint(1, 3)
    hours = {n: f"{n} hour{'s' * (n != 1)}" for n in (t, s)}
    return (
        f"A train travels at {v} km/h for {hours[t]} and then at {w} km/h for {hours[s]}. How many kilometres does it travel?",
        f"{v}*{t} + {w}*{s} = {v * t} + {w * s} = {v * t + w * s}.",
        Fraction(v * t + w * s),
    )


def mean(r: random.Random):
    xs = [r.randint(50, 100) for _ in range(r.randint(4, 6))]
    return (
        f"A student's test scores are {', '.join(map(str, xs))}. What is the mean score?",
        f"The sum is {sum(xs)} over {len(xs)} tests: {sum(xs)}/{len(xs)} = {fmt(Fraction(sum(xs), len(xs)))}.",
        Fraction(sum(xs), len(xs)),
    )


def linear(r: random.Random):
    a, x, b = r.choice([2, 3, 4, 5, 6, 7, -2, -3]), r.randint(-12, 12), r.randint(-20, 20)
    c = a * x + b
    return (
        f"Solve for x: {a}x {'+' if b >= 0 else '-'} {abs(b)} = {c}.",
        f"{a}x = {c} - ({b}) = {c - b}, so x = {c - b}/{a} = {x}.",
        Fraction(x),
    )


def work_rate(r: random.Random):
    a, b = r.sample([2, 3, 4, 5, 6, 8, 10, 12], 2)
    t = Fraction(a * b, a + b)
    return (
        f"Pipe A fills a tank in {a} hours and pipe B fills it in {b} hours. How many hours do they take to fill it together?",
        f"Together they fill 1/{a} + 1/{b} = {fmt(Fraction(1, a) + Fraction(1, b))} of the tank per hour, "
        f"so they need {fmt(t)} hours.",
        t,
    )


def ages(r: random.Random):
    bob, k, n = r.randint(3, 15), r.randint(2, 4), r.randint(2, 10)
    total = (k + 1) * bob + 2 * n
    return (
        f"Alice is {k} times as old as Bob. In {n} years the sum of their ages will be {total}. How old is Bob now?",
        f"With Bob's age b: {k}b + b + 2*{n} = {total}, so {k + 1}b = {total - 2 * n} and b = {bob}.",
        Fraction(bob),
    )


def leftover_bread(r: random.Random):
    a, b = r.choice([2, 3, 4, 5]), r.choice([2, 3, 4])
    n = a * b * r.randint(2, 8)
    left = Fraction(n) * (1 - Fraction(1, a)) * (1 - Fraction(1, b))
    return (
        f"A baker makes {n} loaves. She sells 1/{a} of them in the morning and 1/{b} of the remaining loaves in the "
        "afternoon. How many loaves are left?",
        f"After the morning {n - n // a} remain; the afternoon sells {fmt(Fraction(n - n // a, b))}, leaving {fmt(left)}.",
        left,
    )


def series(r: random.Random):
    a, d, n = r.randint(1, 10), r.randint(2, 7), r.randint(8, 25)
    s = n * (2 * a + (n - 1) * d) // 2
    return (
        f"What is the sum of the first {n} terms of the arithmetic sequence {a}, {a + d}, {a + 2 * d}, ...?",
        f"n(2a + (n-1)d)/2 = {n}*(2*{a} + {n - 1}*{d})/2 = {s}.",
        Fraction(s),
    )


def interest(r: random.Random):
    p, rate, years = r.choice([1000, 2000, 5000]), r.choice([5, 10, 20]), r.choice([2, 3])
    total = p * (1 + Fraction(rate, 100)) ** years
    return (
        f"${p} is invested at {rate}% annual interest, compounded yearly. How many dollars is it worth after {years} years?",
        f"{p} * (1 + {rate}/100)^{years} = {fmt(total)}.",
        total,
    )


def quadratic(r: random.Random):
    r1, r2 = r.sample(range(-9, 10), 2)
    b, c = -(r1 + r2), r1 * r2
    eq = f"x^2 {'+' if b >= 0 else '-'} {abs(b)}x {'+' if c >= 0 else '-'} {abs(c)} = 0"
    return (
        f"The equation {eq} has two integer roots. What is the larger root?",
        f"It factors as (x - ({r1}))(x - ({r2})) = 0, so the roots are {r1} and {r2}.",
        Fraction(max(r1, r2)),
    )


def system(r: random.Random):
    x, y = r.randint(-8, 8), r.randint(-8, 8)
    a1, b1, a2, b2 = r.randint(1, 5), r.randint(1, 5), r.randint(1, 5), -r.randint(1, 5)
    c1, c2 = a1 * x + b1 * y, a2 * x + b2 * y
    det = a1 * b2 - a2 * b1
    return (
        f"Solve the system {a1}x + {b1}y = {c1} and {a2}x - {-b2}y = {c2}. What is x + y?",
        f"By Cramer's rule (determinant {det}) x = {x} and y = {y}, so x + y = {x + y}.",
        Fraction(x + y),
    )


def ratio(r: random.Random):
    p, q = r.sample(range(1, 8), 2)
    total = (p + q) * r.randint(3, 12)
    return (
        f"A bag holds red and blue marbles in the ratio {p}:{q}. There are {total} marbles. How many are red?",
        f"Each share is {total}/{p + q} = {total // (p + q)} marbles; red is {p} shares: {p * total // (p + q)}.",
        Fraction(p * total, p + q),
    )


TEMPLATES: list[tuple[str, int, Template]] = [
    ("shopping", 1, shopping), ("discount", 1, discount), ("rectangle", 1, rectangle), ("travel", 1, travel),
    ("mean", 1, mean), ("linear", 2, linear), ("work_rate", 2, work_rate), ("ages", 2, ages),
    ("leftover_bread", 2, leftover_bread), ("series", 2, series), ("interest", 2, interest), ("ratio", 2, ratio),
    ("quadratic", 3, quadratic), ("system", 3, system),
]  # fmt: skip


def problems(seed: int = SEED, per_template: int = 3) -> list[Problem]:
    out = []
    for name, difficulty, make in TEMPLATES:
        for k in range(per_template):
            question, steps, value = make(random.Random(f"{seed}/{name}/{k}"))
            out.append(Problem(f"{name}-{k}", difficulty, question, steps, Fraction(value)))
    return out


def to_task(p: Problem, run_id: str, group_size: int, index: int) -> Task:
    return suite_task(SUITE, p, run_id, group_size, index, prompt=p.prompt, max_tokens=512,
                      verifier=VerifierSpec(kind="math", data={"suite": SUITE, "answer": p.answer}))  # fmt: skip
