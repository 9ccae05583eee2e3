"""Questions about pictures drawn with Pillow, each with an exact answer.

Four kinds, each picture drawn from a ``random.Random`` seeded by the problem id, so the suite
is the same on every machine:

- ``count``: shapes of several colours; how many are <colour>? (0-4)
- ``largest``: a circle, a square and a triangle of different sizes; which is largest?
- ``digits``: a string of 2-4 digits written on the picture; what does it say?
- ``bars``: two bars; is the left or the right one taller?

The ``math`` verifier compares the model's ``\\boxed{...}`` with ``answer`` (words compare
case-insensitively). ``reference`` is the right answer boxed, ``wrong`` a wrong one (a teacher
that is sometimes wrong warms a model up with both). Pictures are ``SIZE`` pixels a side,
small enough that a tiny vision tower sees them in a handful of tokens; the task carries a
reference to the PNG in the object store (``conveyor.images``), never the pixels.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

from conveyor.contracts import ChatMessage, Task, TextPart, VerifierSpec
from conveyor.images import encode_png
from tasks.suites import split_of, suite_task

if TYPE_CHECKING:
    from PIL import Image as PILImage

    from conveyor.images import PutImage

SUITE = "visual"
SEED = 11
SIZE = 112
NEEDS_IMAGES = True
"""``to_task`` takes a ``put_image`` that stores each picture (producers/sources.py)."""
COLOURS = {"red": (220, 30, 30), "green": (30, 160, 60), "blue": (40, 70, 220), "yellow": (230, 200, 20)}
SHAPES = ("circle", "square", "triangle")
KINDS = ("count", "largest", "digits", "bars")


def _shape(draw, kind: str, x: int, y: int, r: int, fill) -> None:
    box = (x - r, y - r, x + r, y + r)
    if kind == "circle":
        draw.ellipse(box, fill=fill)
    elif kind == "square":
        draw.rectangle(box, fill=fill)
    else:
        draw.polygon([(x, y - r), (x - r, y + r), (x + r, y + r)], fill=fill)


def _cells(rng: random.Random, n: int, grid: int = 3) -> list[tuple[int, int]]:
    """``n`` distinct cell centres of a grid over the picture: shapes never overlap."""
    step = SIZE // grid
    cells = rng.sample([(i, j) for i in range(grid) for j in range(grid)], n)
    return [(i * step + step // 2, j * step + step // 2) for i, j in cells]


@dataclass(frozen=True)
class Problem:
    id: str
    kind: str
    difficulty: int
    question: str
    answer: str
    choices: tuple[str, ...]
    """Every answer a question of this kind can have (the wrong answer is one of the others)."""
    subject: str = ""  # the colour a count question asks about

    @property
    def split(self) -> str:
        return split_of(SUITE, self.id)

    @property
    def prompt(self) -> str:
        return f"{self.question} Answer in \\boxed{{}}."

    @property
    def reference(self) -> str:
        return f"\\boxed{{{self.answer}}}"

    @property
    def wrong(self) -> str:
        others = [c for c in self.choices if c != self.answer]
        return f"\\boxed{{{random.Random(self.id).choice(others)}}}"

    def draw(self) -> PILImage.Image:
        from PIL import Image, ImageDraw

        rng = random.Random(f"{SEED}/{self.id}/picture")
        img = Image.new("RGB", (SIZE, SIZE), (255, 255, 255))
        d = ImageDraw.Draw(img)
        if self.kind == "count":
            colour = self.subject
            target = int(self.answer)
            others = [c for c in COLOURS if c != colour]
            fills = [colour] * target + [rng.choice(others) for _ in range(rng.randint(1, 4))]
            for (x, y), name in zip(_cells(rng, len(fills)), fills, strict=True):
                _shape(d, rng.choice(SHAPES), x, y, 12, COLOURS[name])
        elif self.kind == "largest":
            others = [s for s in SHAPES if s != self.answer]
            radii = {self.answer: 16, **dict(zip(others, rng.sample([5, 8], 2), strict=True))}
            for (x, y), shape in zip(_cells(rng, 3), SHAPES, strict=True):
                _shape(d, shape, x, y, radii[shape], COLOURS[rng.choice(list(COLOURS))])
        elif self.kind == "digits":
            from PIL import ImageFont

            font = ImageFont.load_default(size=28)
            d.text((8, SIZE // 2 - 16), self.answer, fill=(0, 0, 0), font=font)
        else:  # bars
            tall, short = rng.randint(60, 100), rng.randint(15, 50)
            left, right = (tall, short) if self.answer == "left" else (short, tall)
            d.rectangle((20, SIZE - 6 - left, 48, SIZE - 6), fill=COLOURS["blue"])
            d.rectangle((64, SIZE - 6 - right, 92, SIZE - 6), fill=COLOURS["blue"])
        return img

    def png(self) -> bytes:
        return encode_png(self.draw())


def _make(kind: str, k: int, seed: int) -> Problem:
    rng = random.Random(f"{seed}/{kind}/{k}")
    pid = f"{kind}-{k}"
    if kind == "count":
        colour, n = rng.choice(list(COLOURS)), rng.randint(0, 4)
        return Problem(pid, kind, 2, f"How many shapes are {colour}?", str(n), tuple(map(str, range(5))), colour)
    if kind == "largest":
        return Problem(pid, kind, 1, "Which shape is the largest: circle, square or triangle?", rng.choice(SHAPES), SHAPES)
    if kind == "digits":
        text = "".join(rng.choice("0123456789") for _ in range(rng.randint(2, 4)))
        wrong = str((int(text) + 1) % 10 ** len(text)).zfill(len(text))
        return Problem(pid, kind, 3, "What number is written in the picture?", text, (text, wrong))
    return Problem(
        pid, kind, 1, "Which bar is taller, the left or the right one?", rng.choice(("left", "right")), ("left", "right")
    )


def problems(seed: int = SEED, per_kind: int = 50, kinds: tuple[str, ...] = KINDS) -> list[Problem]:
    return [_make(kind, k, seed) for kind in kinds for k in range(per_kind)]


def to_task(p: Problem, run_id: str, group_size: int, index: int, put_image: PutImage | None = None) -> Task:
    if put_image is None:
        raise ValueError("the visual suite's tasks carry pictures: give put_image (an object store to keep them)")
    message = ChatMessage(role="user", content=[put_image(p.png()), TextPart(text=p.prompt)])
    return suite_task(SUITE, p, run_id, group_size, index, messages=[message], max_tokens=16,
                      verifier=VerifierSpec(kind="math", data={"suite": SUITE, "answer": p.answer}))  # fmt: skip
