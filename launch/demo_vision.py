"""``conveyor demo --vision``: the same pipeline learning a task it must see.

A vision-language model of Qwen2-VL's architecture (tiny, random-initialised, a character
tokenizer with the ChatML and vision tokens, its image processor) is warmed up on the visual
suite's pictures (``tasks/suites/visual.py``) by a teacher that is wrong, with probability
``warmup_noise``, on the cases it confuses (a taller bar on the left, a largest shape that is a
triangle). Then the services of ``launch/demo.py`` run asynchronous RL on the pictures: tasks
carry references to PNGs in the object store, the rollout worker samples with the pictures
(``rollout_workers/vision_engine.py``), the reward bridge checks the boxed answer, the learner
trains on the sequences whole with their pixels (``learner/vision.py``) and the lake stores the
references. The evaluator's held-out greedy pass rate is the figure.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

KINDS = ("bars", "largest")
ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 ?,.:\\{}\n"


def confused(problem) -> bool:
    """The cases the warm-up teacher gets wrong (with probability ``warmup_noise``)."""
    return (problem.kind == "bars" and problem.answer == "left") or (problem.kind == "largest" and problem.answer == "triangle")


def teacher(problem, rng: random.Random, noise: float) -> str:
    return problem.wrong if confused(problem) and rng.random() < noise else problem.reference


class Pictures:
    """The demo's problems as prompts (token ids) and pictures, each drawn and stored once."""

    def __init__(self, prompting, store) -> None:
        from conveyor.images import ImageKeeper

        self.prompting = prompting
        self.store = store
        self.keep = ImageKeeper(lambda: store)
        self._cache: dict[str, tuple[list[int], object]] = {}

    def __call__(self, problem) -> tuple[list[int], object]:
        from conveyor.contracts import ChatMessage, TextPart
        from conveyor.images import load_image

        if problem.id not in self._cache:
            part = self.keep(problem.png())
            message = ChatMessage(role="user", content=[part, TextPart(text=problem.prompt)])
            self._cache[problem.id] = (self.prompting.encode_prompt([message]), load_image(self.store, part))
        return self._cache[problem.id]


def warm_up(model, prompting, pictures: Pictures, train: list, *, steps: int, noise: float, lr: float,
            rng: random.Random, batch: int = 32) -> float:  # fmt: skip
    """Supervised steps on the teacher's answers, the pictures through the vision tower."""
    import torch

    from learner.vision import vision_logprobs

    tok = prompting.tokenizer
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    loss = float("nan")
    for _ in range(steps):
        chosen = [rng.choice(train) for _ in range(batch)]
        items = [pictures(p) for p in chosen]
        answers = [tok(teacher(p, rng, noise), add_special_tokens=False).input_ids + [tok.eos_token_id] for p in chosen]
        model.train()
        logps = vision_logprobs(model, prompting, [i[0] for i in items], answers, [[i[1]] for i in items], tok.pad_token_id)
        value = -torch.cat(logps).mean()
        optimizer.zero_grad(set_to_none=True)
        value.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        loss = float(value.detach())
    return loss


class VisionEvaluator:
    """Greedy held-out pass rate, judged by the math verifier the reward bridge runs."""

    def __init__(self, engine, pictures: Pictures, problems: list, run_id: str) -> None:
        from tasks.suites.visual import to_task

        self.engine = engine
        self.items = [pictures(p) for p in problems]
        self.tasks = [to_task(p, run_id, 1, i, put_image=pictures.keep) for i, p in enumerate(problems)]

    def pass_rate(self) -> float:
        from tasks.math_answers import judge_math

        passed = 0
        for lo in range(0, len(self.items), 50):
            chunk = self.items[lo : lo + 50]
            outs = self.engine.generate([i[0] for i in chunk], 1, max_new_tokens=16, greedy=True, images=[[i[1]] for i in chunk])
            for task, out in zip(self.tasks[lo : lo + 50], outs, strict=True):
                passed += judge_math(task, self.engine.decode(out[0].token_ids)).verdict == "pass"
        return passed / len(self.items)


def task_stream(problems: list, run_id: str, group_size: int, keep, rng: random.Random):
    """The train problems, a new order every pass."""
    from tasks.suites.visual import to_task

    index = 0
    while True:
        order = list(problems)
        rng.shuffle(order)
        for p in order:
            yield to_task(p, run_id, group_size, index, put_image=keep)
            index += 1


def prepare(cfg, run_id: str, run_dir: Path, store, rng: random.Random) -> dict:
    """The warmed-up model, engines, evaluator and task stream of a vision demo (the ``ctx`` that
    ``launch.demo._run_services`` runs)."""
    import torch
    from transformers import AutoModelForImageTextToText

    from conveyor.vision import VisionPrompting
    from learner.models import char_tokenizer, create_tiny_qwen2_vl
    from rollout_workers.vision_engine import VisionReferenceEngine
    from storage.model_export import store_model_files
    from tasks.suites import visual

    t0 = time.monotonic()
    model_dir = run_dir / "model"
    create_tiny_qwen2_vl(model_dir, char_tokenizer(ALPHABET), seed=cfg.seed)
    prompting = VisionPrompting(model_dir)
    pictures = Pictures(prompting, store)
    problems = visual.problems(per_kind=cfg.vision_problems, kinds=KINDS)
    train = [p for p in problems if p.split == "train"]
    heldout = [p for p in problems if p.split == "heldout"][: cfg.heldout_size]
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    torch.set_num_threads(2)
    loss = warm_up(model, prompting, pictures, train, steps=cfg.warmup_steps, noise=cfg.warmup_noise, lr=cfg.warmup_lr, rng=rng)
    torch.set_num_threads(cfg.threads_per_role)
    model.save_pretrained(model_dir)
    store_model_files(store, run_id, model_dir)
    log.info("demo.warmup_done", loss=round(loss, 4), seconds=round(time.monotonic() - t0, 1))
    engine = VisionReferenceEngine(model_dir, seed=cfg.seed)
    eval_engine = VisionReferenceEngine(model_dir, seed=cfg.seed)
    evaluator = VisionEvaluator(eval_engine, pictures, heldout, run_id)
    return {
        "model": model,  # the warmed-up weights, as saved: the learner's own copy (the engines loaded theirs)
        "pad_id": prompting.tokenizer.pad_token_id,
        "vision": prompting,
        "engine": engine,
        "eval_engine": eval_engine,
        "evaluator": evaluator,
        "sandbox": None,  # the math verifier runs in the reward bridge's process
        "tasks": task_stream(train, run_id, cfg.run.producer.group_size, pictures.keep, rng),
    }
