"""Held-out evaluation through the engines and verifiers the run trains with.

Each task is sampled ``samples`` times by the same engine a rollout worker serves (reference or
vLLM, the model's chat template, its end-of-turn tokens) and every completion is judged by the
task's own verifier (``tasks/verifiers.py``, programs in the sandbox). The report gives:

- ``pass@1`` and ``pass@k``: the unbiased estimator of Chen et al. (2021),
  ``1 - C(n - c, k) / C(n, k)`` per task (n samples, c passing), averaged over tasks;
- the mean reward and the mean completion length in tokens;
- one line per task (its samples' verdicts), for a JSON report.

With one sample per task and ``temperature`` 0 the completions are greedy.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from conveyor.contracts import Task
from rollout_workers.engine import SamplingRequest, cut_at_stop_strings, stop_rules
from tasks.verifiers import score_batch


def pass_at_k(n: int, c: int, k: int) -> float:
    """The probability that at least one of ``k`` samples drawn from ``n`` (``c`` of them passing)
    passes, without replacement: the unbiased pass@k estimator."""
    if not 0 <= c <= n or k < 1 or k > n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


@dataclass
class TaskResult:
    task_id: str
    passed: int
    samples: int
    rewards: list[float]
    verdicts: list[str]
    tokens: list[int]
    completions: list[str]


@dataclass
class EvalReport:
    tasks: int
    samples_per_task: int
    k: int
    pass_at_1: float
    pass_at_k: float
    mean_reward: float
    mean_tokens: float
    per_task: list[TaskResult] = field(default_factory=list)

    def summary(self) -> dict:
        out = asdict(self)
        out.pop("per_task")
        return out

    def to_json(self) -> dict:
        return asdict(self)


async def evaluate(
    engine,
    sandbox,
    tasks: Sequence[Task],
    *,
    k: int = 1,
    samples: int | None = None,
    temperature: float | None = None,
    max_tokens: int = 512,
    top_p: float = 1.0,
    stop: tuple[str, ...] = (),
    on_task=None,
) -> EvalReport:
    """Sample and judge every task (an opened engine: ``rollout_workers.engines.open_engine``).

    ``samples`` (default ``k``) completions per task; ``temperature`` defaults to 0 (greedy) for
    one sample and to 1 otherwise. A task's own ``sampling`` wins for its length and stop strings
    (``max_tokens`` and ``stop`` are for tasks without). ``on_task(1)`` as each task is sampled."""
    n = samples or k
    if k < 1 or n < k:
        raise ValueError(f"need 1 <= k <= samples (k={k}, samples={n})")
    if not tasks:
        raise ValueError("no tasks to evaluate")
    temp = (0.0 if n == 1 else 1.0) if temperature is None else temperature

    async def sample(task: Task):
        sp = task.sampling
        stops = tuple(sp.stop) if sp else stop
        stop_ids, texts = stop_rules(stops, engine.encode)
        request = SamplingRequest(
            engine.encode_prompt(task.prompt, task.messages, task.tools),
            n=n,
            max_tokens=sp.max_tokens if sp else max_tokens,
            temperature=max(temp, 1e-6),
            top_p=top_p,
            stop_token_ids=stop_ids,
            greedy=temp == 0.0,
        )
        completions = await engine.generate(request)
        if on_task is not None:  # sampled (the CLI's progress; judging follows, in one batch)
            on_task(1)
        return [cut_at_stop_strings(c, texts, engine.decode) for c in completions] if texts else completions

    sampled = await asyncio.gather(*(sample(t) for t in tasks))
    items = [(t, engine.decode(c.token_ids)) for t, cs in zip(tasks, sampled) for c in cs]
    verdicts = await asyncio.to_thread(score_batch, sandbox, items)
    per_task = []
    for i, (task, cs) in enumerate(zip(tasks, sampled)):
        vs = verdicts[i * n : (i + 1) * n]
        per_task.append(
            TaskResult(
                task_id=task.task_id,
                passed=sum(v.verdict == "pass" for v in vs),
                samples=n,
                rewards=[v.reward for v in vs],
                verdicts=[v.verdict for v in vs],
                tokens=[len(c.token_ids) for c in cs],
                completions=[text for _, text in items[i * n : (i + 1) * n]],
            )
        )
    return EvalReport(
        tasks=len(per_task),
        samples_per_task=n,
        k=k,
        pass_at_1=sum(pass_at_k(n, r.passed, 1) for r in per_task) / len(per_task),
        pass_at_k=sum(pass_at_k(n, r.passed, k) for r in per_task) / len(per_task),
        mean_reward=sum(sum(r.rewards) for r in per_task) / (n * len(per_task)),
        mean_tokens=sum(sum(r.tokens) for r in per_task) / (n * len(per_task)),
        per_task=per_task,
    )
