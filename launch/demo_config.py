"""``conveyor demo``'s settings: a run config, whose sections the services read as a distributed
run's do (``conveyor/config.py`` declares them and their checks once), and the few settings only
the demo has (the warm-up, the budget, the evaluations, where things run)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conveyor.config import RunConfig, with_overrides

# The demo's run: every role in one process on in-memory topics, a local process pool for the
# sandbox. Where a value differs from the run config's default, the comment says why.
DEMO_RUN: dict[str, Any] = {
    "run_id": "demo",
    "transport": {"type": "memory", "partitions": 4},
    "object_store": {"type": "local", "root": "runs/objects"},
    "celery": {"type": "local"},
    "producer": {"suite": "pyexpr", "group_size": 8, "http_port": None},
    "learner": {
        "batch_groups": 16,
        # Policy versions a sample may lag the learner. 3: with four batches in flight generation, scoring
        # and training overlap more than at 1 (~7% more steps/s), and the demo's task reaches a held-out 0.9
        # in no more learner steps (docs/BENCHMARKS.md, "Why 0.9 and lag 3").
        "max_lag": 3,
        "lr": 5e-4,
        "checkpoint_every": 25,
        "keep_versions": 3,
        # Padded batches: the demo's sequences are short and alike, and packing them into one row with
        # a block-causal mask costs 2.5x the step on CPU (dense attention over the whole pack).
        "pack_tokens": 0,
        # One optimizer update per batch: two reach 0.85 no sooner, and at lr 5e-4 about one seed-0 run in
        # three unlearns a[0] (docs/BENCHMARKS.md, "The demo's settings").
        "updates_per_batch": 1,
        # The optimizer steps in a child process (learner/step_process.py): as a thread they contend for
        # the GIL with the engine and the event loop's services (docs/BENCHMARKS.md, "The demo's
        # settings").
        "step_process": True,
    },
    "rollout": {"engine": "reference", "tasks_per_batch": 16},
    "reward": {"timeout_s": 1.0},  # the demo's programs are one expression each
    "sink": {"flush_s": 2.0},
    "logging": {"format": "console"},
}


VISION_RUN: dict[str, Any] = {
    **DEMO_RUN,
    "producer": {"suite": "visual", "group_size": 8, "http_port": None},
    # The vision-language model's steps run in the learner's process (its pixels do not cross to a step process).
    "learner": {**DEMO_RUN["learner"], "step_process": False, "lr": 1e-3, "max_lag": 1},
    "rollout": {"engine": "reference", "tasks_per_batch": 16},
}


def demo_run_config(overrides: dict[str, Any] | None = None, source: str = "the demo's options") -> RunConfig:
    """The demo's run config with ``overrides`` (sections of fields, as in a run config file);
    a bad value raises ConfigError naming the field."""
    return with_overrides(DEMO_RUN, overrides or {}, source)


@dataclass
class DemoConfig:
    run: RunConfig = field(default_factory=demo_run_config)
    seed: int = 0
    run_id: str | None = None  # None: demo-<sync|async>-s<seed>-<time>
    out_dir: Path = Path("runs")
    warmup_steps: int = 800
    warmup_noise: float = 0.7
    warmup_lr: float = 1e-3
    rl_budget_s: float = 90.0
    max_steps: int | None = None
    # The engine in a child process (rollout_workers/process_engine.py): as a thread it contends for
    # the GIL with the learner and the event loop's services.
    engine_process: bool = True
    heldout_size: int = 100
    eval_every_s: float = 3.0  # wall-clock cadence: the same evaluation cost per second in sync and async runs; 0: none
    sync: bool = False  # lock step: the learner's max_lag is 0
    threads_per_role: int = 1
    target_pass_rate: float | None = None  # stop early once held-out reaches it
    vision: bool = False  # the visual suite with a tiny vision-language model (launch/demo_vision.py)
    vision_problems: int = 300  # problems of each visual kind the vision demo draws (80 % train)

    @classmethod
    def for_vision(cls, run: dict[str, Any] | None = None, **demo: Any) -> DemoConfig:
        """The vision demo's settings: its own warm-up and budget, the visual suite's run."""
        overrides = with_overrides(VISION_RUN, run or {}, "the vision demo's options")
        defaults = {"warmup_steps": 400, "warmup_noise": 0.6, "warmup_lr": 2e-3, "rl_budget_s": 120.0, "heldout_size": 100,
                    "eval_every_s": 15.0, "engine_process": False}  # fmt: skip
        return cls(run=overrides, vision=True, **{**defaults, **demo})

    @classmethod
    def create(cls, run: dict[str, Any] | None = None, **demo: Any) -> DemoConfig:
        """``run``: run-config overrides (``{"learner": {"max_lag": 2}}``); ``demo``: the demo's own settings."""
        return cls(run=demo_run_config(run), **demo)

    @property
    def engine(self) -> str:
        return self.run.rollout.engine

    def effective_run(self, run_id: str) -> RunConfig:
        """The run config the services get: the run id, lock step's lag, the engine's tasks in flight."""
        learner = {"max_lag": 0} if self.sync else {}
        rollout = {}
        if self.run.rollout.max_inflight_tasks is None:  # twice a batch keeps vLLM's continuous batching fed
            rollout["max_inflight_tasks"] = self.run.learner.batch_groups * (2 if self.engine == "vllm" else 1)
        return with_overrides(self.run, {"run_id": run_id, "learner": learner, "rollout": rollout}, "the demo's run config")
