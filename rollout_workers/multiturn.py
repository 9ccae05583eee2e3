"""Multi-turn self-correction: attempt, execute, read the feedback, try again.

For a task with ``max_turns > 1`` each of the group's samples is an episode.
The first attempts are one request of ``n = group_size``; every attempt is
sent to the reward service (the same scorer the bridge uses: the sandbox in
embedded mode, Celery in a deployment) and a failing attempt gets the parsed
feedback (exception, message, line, failing test) appended as an observation,
after which the model continues from the whole episode so far. An episode ends
when an attempt passes, when ``max_turns`` attempts were made, or when the
context would exceed ``max_context_tokens``.

Token-in, token-out: the model's own tokens are never re-tokenised. The
episode's completion is ``attempt_1 + observation_1 + attempt_2 + ...``;
observation tokens carry loss mask 0 and logprob 0 (they were not sampled),
and each attempt's version segments are shifted to its place in the episode.
The text of every turn is kept in ``Rollout.turns``; the bridge scores the
last attempt (a tool episode: its net script, see tasks/terminal_tools.py).
For a chat task the observation is framed by the model's chat template as a
turn of its own (a ``tool`` turn for tool calls, else ``user``; the frame is
found by rendering marker contents, ``conveyor.hf.observation_frame``), so the
model reads it as the conversation it was trained on; the frame's tokens carry
loss mask 0 like the observation's. A plain-text task, or a tokenizer without a
template, gets the observation as plain text.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from conveyor.contracts import Feedback, Task, ToolCall, Turn
from rollout_workers.engine import Completion, SamplingRequest, cut_at_stop_strings


@dataclass
class Episode:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    segments: list[tuple[int, int, int]] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    finish_reason: str = "stop"

    def add_attempt(self, c: Completion, text: str) -> None:
        base = len(self.token_ids)
        self.token_ids += c.token_ids
        self.logprobs += c.logprobs
        self.loss_mask += [1] * len(c.token_ids)
        self.segments += [(base + a, base + b, v) for a, b, v in c.version_segments() if b > a]
        self.turns.append(Turn(role="assistant", text=text))
        self.finish_reason = c.finish_reason

    def add_observation(self, ids: list[int], text: str, role: str = "user") -> None:
        if self.segments:  # observation tokens belong to the segment before them
            a, b, v = self.segments[-1]
            self.segments[-1] = (a, b + len(ids), v)
        self.token_ids += ids
        self.logprobs += [0.0] * len(ids)
        self.loss_mask += [0] * len(ids)
        self.turns.append(Turn(role=role, text=text))  # type: ignore[arg-type]

    def as_completion(self, first_version: int) -> Completion:
        segs = tuple(self.segments) or ((0, len(self.token_ids), first_version),)
        return Completion(list(self.token_ids), list(self.logprobs), self.finish_reason, segs[0][2], segs)


def feedback_text(verdict: str, fb: Feedback | None) -> str:
    """What the model reads after a failed attempt."""
    parts = [f"verdict: {verdict}"]
    if fb is not None:
        if fb.failing_test:
            parts.append(f"failing test: {fb.failing_test}")
        if fb.exception_type or fb.message:
            parts.append(": ".join(p for p in (fb.exception_type, fb.message) if p))
        if fb.line:
            parts.append(f"line {fb.line}")
    return "\n# " + "; ".join(parts) + "\n# try again\n"


async def run_episodes(engine, scorer, task: Task, prompt: list[int], first: SamplingRequest, *, max_context_tokens: int,
                       episode_id: str, sandbox=None, stop_texts: tuple[str, ...] = ()) -> list[tuple[Completion, Episode]]:  # fmt: skip
    """The group's episodes; each result pairs the spliced completion with its episode record.
    With a ``sandbox`` and a ``terminal`` task, turns are tool calls in a persistent workspace
    (tasks/terminal_tools.py); an ``environment`` task's turns step its environment
    (tasks/environments.py; a machine environment's workspace runs on ``sandbox``); otherwise each attempt is judged and its feedback fed back.
    ``stop_texts``: stop strings of several tokens (``engine.stop_rules``), which end every
    attempt, as they end a single-turn completion (one-token ones are in ``first``'s stop ids)."""
    tool_mode = sandbox is not None and task.verifier.kind == "terminal"
    sessions = None
    if tool_mode:
        from tasks.terminal_tools import ToolEpisode

        sessions = await asyncio.to_thread(lambda: [ToolEpisode(sandbox, task) for _ in range(first.n)])
    elif task.verifier.kind == "environment":
        from rollout_workers.refusals import TaskRefused
        from tasks.environments import Session

        try:
            sessions = await asyncio.to_thread(lambda: [Session(task, sandbox) for _ in range(first.n)])
        except Exception as exc:  # noqa: BLE001 - unknown, or its reset fails: this task cannot be served
            raise TaskRefused(
                f"environment {task.verifier.data.get('environment')!r}: {type(exc).__name__}: {exc}"[:500]
            ) from None
    try:
        return await _episodes(engine, scorer, task, prompt, first, max_context_tokens, episode_id, sessions, stop_texts)
    finally:
        for s in sessions or ():
            s.close()


async def _episodes(engine, scorer, task, prompt, first, max_context_tokens, episode_id, sessions, stop_texts=()):
    def cut(completions: list[Completion]) -> list[Completion]:
        return [cut_at_stop_strings(c, stop_texts, engine.decode) for c in completions] if stop_texts else completions

    episodes = [Episode() for _ in range(first.n)]
    completions = cut(await engine.generate(first))
    first_version = completions[0].policy_version if completions else engine.version
    active = list(range(first.n))
    attempts = {i: c for i, c in zip(active, completions)}
    for turn in range(task.max_turns):
        texts = {i: engine.decode(attempts[i].token_ids) for i in active}
        for i in active:
            episodes[i].add_attempt(attempts[i], texts[i])
        if sessions is not None and task.verifier.kind == "environment":
            observations = await asyncio.to_thread(_env_turn, sessions, episodes, texts, active)
        elif sessions is not None:
            observations = await asyncio.to_thread(_tool_turn, sessions, episodes, texts, active)
        elif turn < task.max_turns - 1:
            verdicts = await scorer.score([(task, texts[i], f"{episode_id}/{i}/t{turn}") for i in active])
            observations = {}
            for i, v in zip(active, verdicts):
                if v.verdict not in ("pass", "infra") and attempts[i].finish_reason != "abort":
                    observations[i] = feedback_text(v.verdict, v.feedback)
        if turn == task.max_turns - 1:
            break
        still = []
        for i, text in observations.items():
            role = "tool" if sessions is not None else "user"
            ids = engine.encode_observation(text, role, chat=bool(task.messages), after=attempts[i].token_ids)
            if len(prompt) + len(episodes[i].token_ids) + len(ids) + first.max_tokens <= max_context_tokens:
                episodes[i].add_observation(ids, text, role=role)
                still.append(i)
        if not still:
            break
        nexts = await asyncio.gather(*(
            engine.generate(SamplingRequest(prompt + episodes[i].token_ids, n=1, max_tokens=first.max_tokens,
                                            temperature=first.temperature, top_p=first.top_p,
                                            stop_token_ids=first.stop_token_ids, images=first.images,
                                            request_id=f"{first.request_id}/{i}/t{turn + 1}"))
            for i in still
        ))  # fmt: skip
        attempts = {i: cut(out)[0] for i, out in zip(still, nexts)}
        active = still
    return [(e.as_completion(first_version), e) for e in episodes]


def _env_turn(sessions, episodes: list[Episode], texts: dict[int, str], active: list[int]) -> dict[int, str]:
    """Step each active episode's environment with the model's turn; the observations of those that
    go on. Calls an environment reports (its step's ``info["tool_calls"]``) are kept in the turn."""
    out = {}
    for i in active:
        observation = sessions[i].step(texts[i])
        calls = sessions[i].last.info.get("tool_calls") if sessions[i].last is not None else None
        if calls:
            last = episodes[i].turns[-1]
            records = [_record(c["name"], c["arguments"]) for c in calls]
            episodes[i].turns[-1] = Turn(role="assistant", text=last.text, tool_calls=records)
        if observation is not None:
            out[i] = observation
    return out


def _tool_turn(sessions, episodes: list[Episode], texts: dict[int, str], active: list[int]) -> dict[int, str]:
    """Run each active episode's call in its workspace; the observations of those that go on."""
    from tasks.terminal_tools import as_command, parse_turn

    out = {}
    for i in active:
        call = parse_turn(texts[i])
        if call is None:  # the model is done
            continue
        observation, kept = sessions[i].call(call)
        record = ToolCall(name=call.name, arguments={**call.arguments, "kept": kept, "replay": as_command(call)})
        last = episodes[i].turns[-1]
        episodes[i].turns[-1] = Turn(role="assistant", text=last.text, tool_calls=[record])
        out[i] = observation
    return out


def _record(name: str, arguments: dict) -> ToolCall:
    """A call as the turn keeps it; arguments nested past what a record may hold are left out
    (the model wrote them: the episode goes on, and the tool turn said what became of the call)."""
    try:
        return ToolCall(name=name, arguments=arguments)
    except ValueError:
        return ToolCall(name=name, arguments={"unrecorded": "nested too deep"})
