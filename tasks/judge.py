"""The ``judge`` verifier (RLAIF): an LLM behind any OpenAI-compatible chat endpoint grades each
completion against a rubric the task carries.

``verifier.data``: ``rubric`` (required: what a good answer does, and how to score it),
optionally ``reference`` (a reference answer the judge may compare with) and ``judge`` (which of
the run config's ``reward.judges`` to ask; ``default``). A task names a judge, never a URL: the
endpoints, keys and limits are the operator's (``conveyor/reward_config.py``).

The judge is asked for its reasoning and then a last line ``Score: <n>`` on the judge's scale
(``score_min`` .. ``score_max``); a JSON ``{"score": n}`` answer is read too. The reward is the
score mapped onto [0, 1], a pass at or above ``pass_at``; the judge's reasoning is the feedback a
self-correction turn shows the model. An endpoint that offers constrained decoding can be held
to the format with ``extra_body`` (vLLM: ``{"structured_outputs": {"regex": "Score: [0-9]"}}``).

What a judge does wrong is never a zero reward: an answer with no score, or one off the scale,
and an endpoint unreachable after ``max_retries`` (the ``openai`` client's exponential backoff
on connection errors, 408, 429 and 5xx) score the sample ``error`` with the reason, which the
learner drops. Verdicts are cached per process by (judge, model, rubric, reference, prompt,
completion): a group's identical completions, and a replayed rollout, cost one request.

Requests run on one event loop per process (started lazily, after a Celery worker's fork),
``max_concurrency`` of them in flight per judge, so a batch of samples is graded together rather
than one round trip after another. It runs in the reward worker's process: route ``judge`` to a
queue of its own (``reward.queues``) to scale the workers that wait on judges apart from the
sandbox's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import math
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from conveyor.contracts import Feedback, Task
from conveyor.reward_config import JudgeConfig
from tasks.verdict import Verdict

SYSTEM = (
    "You are a strict grader. Read the rubric, the conversation and the response to grade. "
    "Explain your judgement briefly, then end with a line of the form 'Score: <number>' "
    "where the number is between {lo:g} and {hi:g} ({hi:g} is best)."
)
_SCORE_LINE = re.compile(r"(?i)score\s*[:=]\s*\**\s*(-?\d+(?:\.\d+)?)")

_judges: dict[str, JudgeConfig] = {}
_lock = threading.Lock()
_cache: OrderedDict[str, tuple[float, str, str]] = OrderedDict()  # key -> (score, answer text, judge name)
stats = {"requests": 0, "cache_hits": 0, "errors": 0}
"""This process's counts (the bench and the tests read them)."""


def configure(judges: Mapping[str, JudgeConfig]) -> None:
    """The run config's ``reward.judges``, read by every reward process at start."""
    with _lock:
        _judges.clear()
        _judges.update(judges)
        _cache.clear()
    _Loop.reset()


def messages_for(task: Task, completion: str, cfg: JudgeConfig) -> list[dict[str, str]]:
    """The chat the judge is sent."""
    data = task.verifier.data
    if task.messages:
        convo = "\n".join(f"[{m.role}] {m.text}" for m in task.messages)
    else:
        convo = task.prompt or ""
    parts = [f"# Rubric\n{data['rubric']}", f"# Conversation\n{convo}"]
    if data.get("reference"):
        parts.append(f"# Reference answer\n{data['reference']}")
    parts.append(f"# Response to grade\n{completion}")
    return [
        {"role": "system", "content": SYSTEM.format(lo=cfg.score_min, hi=cfg.score_max)},
        {"role": "user", "content": "\n\n".join(parts)},
    ]


def parse_score(text: str) -> float | None:
    """The judge's score: its last ``Score: n`` line, else a JSON object's ``score``."""
    found = _SCORE_LINE.findall(text)
    if found:
        return float(found[-1])
    try:
        obj = json.loads(text.strip().removeprefix("```json").removeprefix("```").removesuffix("```"))
    except ValueError:
        return None
    score = obj.get("score") if isinstance(obj, dict) else None
    return float(score) if isinstance(score, int | float) and not isinstance(score, bool) else None


def verdict_of(score: float | None, answer: str, cfg: JudgeConfig, name: str) -> Verdict:
    if score is None or not math.isfinite(score):
        return Verdict(0.0, "error", Feedback(message=f"judge {name} answered no score", text=answer[-300:]))
    if not cfg.score_min <= score <= cfg.score_max:
        return Verdict(
            0.0, "error", Feedback(message=f"judge {name} scored {score:g}, off its scale {cfg.score_min:g}..{cfg.score_max:g}")
        )
    reward = (score - cfg.score_min) / (cfg.score_max - cfg.score_min)
    lines = list(_SCORE_LINE.finditer(answer))
    reasoning = answer[: lines[-1].start()] if lines else ""
    feedback = Feedback(message=f"judge {name}: {score:g}/{cfg.score_max:g}", text=reasoning.strip()[-1000:])
    return Verdict(reward, "pass" if reward >= cfg.pass_at else "fail", feedback, {"judge_score": score})


def _key(name: str, cfg: JudgeConfig, task: Task, completion: str) -> str:
    data = task.verifier.data
    prompt = [[m.role, m.text] for m in task.messages] if task.messages else task.prompt
    images = [img.sha256 for img in task.images]  # two pictures under the same words are two prompts
    blob = json.dumps([name, cfg.url, cfg.model, data.get("rubric"), data.get("reference"), prompt, images, completion])
    return hashlib.sha256(blob.encode()).hexdigest()


def judge_verdicts(items: Sequence[tuple[Task, str]]) -> list[Verdict]:
    """One verdict per (task, completion): cached ones at once, the others asked of their judges
    together (``max_concurrency`` in flight per judge)."""
    out: list[Any] = [None] * len(items)
    asks: list[tuple[int, str, JudgeConfig, str]] = []  # (item, judge name, its config, cache key)
    with _lock:
        for i, (task, completion) in enumerate(items):
            data = task.verifier.data
            name = data.get("judge", "default")
            cfg = _judges.get(name) if isinstance(name, str) else None
            if not isinstance(data.get("rubric"), str) or not data["rubric"].strip():
                out[i] = Verdict(
                    0.0, "error", Feedback(message=f"bad task: task {task.task_id}: judge verifier needs data.rubric")
                )
            elif cfg is None:
                known = ", ".join(_judges) or "none configured"
                out[i] = Verdict(0.0, "error", Feedback(message=f"bad task: no judge named {name!r} in reward.judges ({known})"))
            else:
                key = _key(name, cfg, task, completion)
                hit = _cache.get(key) if cfg.cache_size else None
                if hit is not None:
                    _cache.move_to_end(key)
                    stats["cache_hits"] += 1
                    out[i] = _with(verdict_of(hit[0], hit[1], cfg, name), judge_cached=1.0)
                else:
                    asks.append((i, name, cfg, key))
    if asks:
        answers = _Loop.run(_ask_all([(key, name, cfg, items[i][0], items[i][1]) for i, name, cfg, key in asks]))
        for (i, name, cfg, key), (answer, error, seconds) in zip(asks, answers):
            if error is not None:
                stats["errors"] += 1
                out[i] = Verdict(
                    0.0, "error", Feedback(message=f"judge {name}: {error}"), {"judge_failed": 1.0, "judge_seconds": seconds}
                )
                continue
            score = parse_score(answer)
            out[i] = _with(verdict_of(score, answer, cfg, name), judge_cached=0.0, judge_seconds=seconds)
            if out[i].verdict != "error" and cfg.cache_size:
                with _lock:
                    _cache[key] = (score, answer, name)  # type: ignore[assignment]
                    while len(_cache) > cfg.cache_size:
                        _cache.popitem(last=False)
    return out


def _with(v: Verdict, **details: float) -> Verdict:
    """``v`` with the judge's own figures in its details: the reward bridge counts them in Prometheus
    (a Celery pool process serves no metrics of its own), and the lake keeps them per rollout."""
    return dataclasses.replace(v, details={**v.details, **details})


async def _ask_all(asks: list[tuple[str, str, JudgeConfig, Task, str]]) -> list[tuple[str, str | None, float]]:
    """(answer text, None, seconds) or ("", the reason it has none, seconds), per (cache key, judge, ...)
    ask; identical asks share one request."""
    firsts: dict[str, asyncio.Task] = {}
    waits = []
    for key, name, cfg, task, completion in asks:
        if key not in firsts:
            firsts[key] = asyncio.ensure_future(_ask(name, cfg, task, completion))
        waits.append(firsts[key])
    return list(await asyncio.gather(*waits))


async def _ask(name: str, cfg: JudgeConfig, task: Task, completion: str) -> tuple[str, str | None, float]:
    """The judge's answer, or why there is none, and the seconds the request took (retries included,
    not the wait for a ``max_concurrency`` slot)."""
    import openai

    client, gate = _Loop.client(name, cfg)
    async with gate:
        stats["requests"] += 1
        started = time.monotonic()
        try:
            resp = await client.chat.completions.create(
                model=cfg.model,
                messages=messages_for(task, completion, cfg),  # type: ignore[arg-type]
                temperature=cfg.temperature,
                max_tokens=cfg.max_tokens,
                extra_body=cfg.extra_body or None,
            )
        except openai.APIStatusError as exc:
            return "", f"the endpoint answered {exc.status_code}: {str(exc)[:300]}", time.monotonic() - started
        except openai.APIError as exc:  # connection refused, timeout, after the client's retries
            return "", f"unreachable ({type(exc).__name__}: {str(exc)[:300]})", time.monotonic() - started
    seconds = time.monotonic() - started
    choice = resp.choices[0] if resp.choices else None
    text = choice.message.content if choice is not None else None
    return (text, None, seconds) if text else ("", "empty answer", seconds)


class _Loop:
    """This process's event loop for judge requests, in a daemon thread, and its clients (one per
    judge, connections kept alive). Made after a fork: a Celery pool process makes its own."""

    _pid: int | None = None
    _loop: asyncio.AbstractEventLoop | None = None
    _clients: dict[str, tuple[Any, asyncio.Semaphore]] = {}
    _guard = threading.Lock()

    @classmethod
    def reset(cls) -> None:
        with cls._guard:
            cls._pid, cls._loop, cls._clients = None, None, {}

    @classmethod
    def _running(cls) -> asyncio.AbstractEventLoop:
        with cls._guard:
            if cls._loop is None or cls._pid != os.getpid():
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="judge-loop", daemon=True).start()
                cls._pid, cls._loop, cls._clients = os.getpid(), loop, {}
            return cls._loop

    @classmethod
    def run(cls, coro):
        return asyncio.run_coroutine_threadsafe(coro, cls._running()).result()

    @classmethod
    def client(cls, name: str, cfg: JudgeConfig):
        """On the loop's thread: the judge's client and its concurrency gate."""
        if name not in cls._clients:
            from openai import AsyncOpenAI

            client = AsyncOpenAI(base_url=cfg.url, api_key=cfg.api_key.get_secret_value(), timeout=cfg.timeout_s,
                                 max_retries=cfg.max_retries)  # fmt: skip
            cls._clients[name] = (client, asyncio.Semaphore(cfg.max_concurrency))
        return cls._clients[name]
