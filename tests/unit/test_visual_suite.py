"""The visual suite: pictures drawn the same on every machine that show their answer (counted
back off the pixels), right answers that pass the ``math`` verifier and wrong ones that fail, and
a suite stream whose tasks carry references to pictures kept in the object store."""

from __future__ import annotations

import itertools

from conveyor.contracts import ImagePart, TextPart
from conveyor.images import ImageKeeper, image_reference, load_image
from conveyor.objectstore import LocalObjectStore
from producers.sources import suite_stream
from tasks.math_answers import judge_math
from tasks.suites import visual


def blobs(img, colour) -> list[int]:
    """Pixel counts of the 4-connected regions of exactly ``colour``."""
    w, h = img.size
    px = img.load()
    seen, out = set(), []
    for x0, y0 in itertools.product(range(w), range(h)):
        if (x0, y0) in seen or px[x0, y0] != colour:
            continue
        stack, n = [(x0, y0)], 0
        seen.add((x0, y0))
        while stack:
            x, y = stack.pop()
            n += 1
            for nx, ny in ((x + 1, y), (x - 1, y), (x, y + 1), (x, y - 1)):
                if 0 <= nx < w and 0 <= ny < h and (nx, ny) not in seen and px[nx, ny] == colour:
                    seen.add((nx, ny))
                    stack.append((nx, ny))
        out.append(n)
    return out


def test_the_suite_has_every_kind_both_splits_and_unique_ids():
    problems = visual.problems()
    assert {p.kind for p in problems} == set(visual.KINDS)
    assert len({p.id for p in problems}) == len(problems) == 200
    assert {p.split for p in problems} == {"train", "heldout"}
    assert {p.difficulty for p in problems} == {1, 2, 3}
    assert [p.png() for p in problems[:8]] == [p.png() for p in visual.problems()[:8]]  # the same pictures every time


def test_each_picture_shows_its_answer():
    for p in visual.problems(per_kind=20):
        img = p.draw()
        if p.kind == "count":
            assert len(blobs(img, visual.COLOURS[p.subject])) == int(p.answer), p.id
        elif p.kind == "bars":
            col = {side: sum(img.getpixel((x, y)) == visual.COLOURS["blue"] for y in range(visual.SIZE))
                   for side, x in (("left", 34), ("right", 78))}  # fmt: skip
            assert max(col, key=col.get) == p.answer, p.id
        elif p.kind == "largest":
            sizes = [n for c in visual.COLOURS.values() for n in blobs(img, c)]
            assert len(sizes) == 3 and max(sizes) > 1.5 * sorted(sizes)[1], p.id
        else:
            assert p.answer.isdigit() and 2 <= len(p.answer) <= 4
            assert img.getextrema() != ((255, 255),) * 3  # something is written


def test_the_reference_passes_and_the_wrong_answer_fails():
    for i, p in enumerate(visual.problems(per_kind=10)):
        task = visual.to_task(p, "r", 2, i, put_image=image_reference)
        assert judge_math(task, p.reference).verdict == "pass", p.id
        assert judge_math(task, p.wrong).verdict == "fail", p.id


def test_a_visual_suite_stream_keeps_its_pictures_in_the_store(tmp_path):
    store = LocalObjectStore(tmp_path / "s")
    opened = []
    keeper = ImageKeeper(lambda: opened.append(1) or store)
    tasks = list(suite_stream("visual", "r", 4, max_tasks=12, put_image=keeper))
    assert len(opened) == 1  # opened once, on the first picture
    for t in tasks:
        image, text = t.messages[0].content
        assert isinstance(image, ImagePart) and isinstance(text, TextPart) and t.schema_version == 2
        assert load_image(store, image).size == (visual.SIZE, visual.SIZE)
    problem = next(p for p in visual.problems() if p.id == tasks[0].metadata["problem_id"])
    assert load_image(store, tasks[0].images[0]).tobytes() == problem.draw().tobytes()
