"""Conveyor against the tool a user would pick instead: Hugging Face TRL's ``GRPOTrainer``.

The same warmed-up model (the demo's, per seed: ``conveyor demo`` warms it up and saves it under
its run directory before RL), the same task stream (the pyexpr suite, the held-out problems left
out), the same reward (``tasks.verifiers.score_batch`` in the same bubblewrap sandbox), the same
held-out set and greedy evaluation, the same two cores. Conveyor is ``conveyor demo`` (async, its
default settings); TRL is ``GRPOTrainer`` with its own generation (``model.generate``) and the
settings a competent user would pick for this task, matched to the demo's where both have them:

- 8 completions per prompt, 16 prompts per step (128 completions), at most 5 new tokens,
  temperature 1.0, lr 5e-4 (the demo's), AdamW without weight decay, a constant schedule (the
  run is cut by time, so a decay to zero over ``max_steps`` would be arbitrary), no KL (``beta 0``,
  as the demo), TRL's default loss and group reward scaling;
- the newline ends a completion, as the demo's stop string does: the tokenizer's EOS is set to it,
  so TRL's generation stops there and its completion mask ends there.

Time is training time: from the first step, evaluations excluded for TRL (its callback pauses the
clock); Conveyor's evaluations run beside its training (the demo's evaluator), so its time includes
their share of the CPU. Each run stops at held out 0.9 or after ``--budget`` seconds; a threshold not
reached is censored and reported as such.

    python3 -m pip install -e '.[compare]'        # TRL: only this benchmark uses it
    python3 bench/vs_trl.py [--seeds 0 1 2] [--budget 120] [--eval-every 3] [--heldout 100]

Ends with ``FIGURE conveyor_vs_trl_speedup <x> x``: TRL's time to held out 0.9 over Conveyor's,
the geometric mean over the seeds where both reached it (and the time to 0.8 and 0.85 per seed).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])  # the repository root, not bench/

import argparse
import json
import math
import random
import shutil
import tempfile
import time

THRESHOLDS = (0.8, 0.85, 0.9)
GROUP, PROMPTS_PER_STEP, MAX_TOKENS, LR = 8, 16, 5, 5e-4


def time_to(evals: list[dict], threshold: float) -> float | None:
    return next((e["wall_s"] for e in evals if e["pass_rate"] >= threshold), None)


def conveyor_run(seed: int, args, work: Path) -> tuple[Path, list[dict]]:
    from launch.demo import DemoConfig, run_demo

    cfg = DemoConfig.create(seed=seed, run_id=f"vs-trl-s{seed}", out_dir=work, rl_budget_s=args.budget,
                            eval_every_s=args.eval_every, heldout_size=args.heldout,
                            target_pass_rate=max(THRESHOLDS))  # fmt: skip
    res = run_demo(cfg)
    return res.run_dir / "model", res.evals


def trl_run(seed: int, model_dir: Path, args, work: Path) -> list[dict]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from sandbox.runner import Sandbox
    from tasks.suites.pyexpr import heldout_set, sample_problems, to_task
    from tasks.verifiers import score_batch

    torch.manual_seed(seed)
    policy = work / f"trl-s{seed}"
    shutil.copytree(model_dir, policy)
    tok = AutoTokenizer.from_pretrained(policy)
    tok.eos_token = "\n"  # the demo's stop string ends a completion
    tok.padding_side = "left"
    tok.save_pretrained(policy)
    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id

    heldout = [to_task(p, "trl", 1, i, "heldout") for i, p in enumerate(heldout_set(args.heldout))]
    held = {t.prompt for t in heldout}
    stream = sample_problems(random.Random(seed))
    train = [p for p in (next(stream) for _ in range(40_000)) if p.prompt not in held]
    by_prompt = {p.prompt: to_task(p, "trl", GROUP, i) for i, p in enumerate(train)}
    sandbox = Sandbox.from_config(_reward_config(), warm=True)

    def reward(prompts, completions, **_):
        return [v.reward for v in score_batch(sandbox, [(by_prompt[p], c) for p, c in zip(prompts, completions)])]

    def pass_rate(m) -> float:
        m.eval()
        outs: list[str] = []
        with torch.no_grad():
            for i in range(0, len(heldout), 50):
                batch = tok([t.prompt for t in heldout[i : i + 50]], return_tensors="pt", padding=True,
                            add_special_tokens=False)  # fmt: skip
                gen = m.generate(**batch, max_new_tokens=MAX_TOKENS, do_sample=False)
                outs += tok.batch_decode(gen[:, batch.input_ids.shape[1] :], skip_special_tokens=True)
        m.train()
        verdicts = score_batch(sandbox, list(zip(heldout, outs)))
        return sum(v.verdict == "pass" for v in verdicts) / len(heldout)

    class Clock(TrainerCallback):
        """Training time, evaluations excluded; evaluates every ``eval_every`` s and stops the run."""

        def __init__(self) -> None:
            self.evals = [{"step": 0, "wall_s": 0.0, "pass_rate": pass_rate(model)}]
            self.train_s, self.mark, self.last_eval = 0.0, 0.0, 0.0

        def on_train_begin(self, args_, state, control, **kw):
            self.mark = time.monotonic()

        def on_step_end(self, args_, state, control, model=None, **kw):
            self.train_s += time.monotonic() - self.mark
            if self.train_s - self.last_eval >= args.eval_every or self.train_s >= args.budget:
                rate = pass_rate(model)
                self.evals.append({"step": state.global_step, "wall_s": round(self.train_s, 2), "pass_rate": rate})
                print(f"trl seed {seed}: step {state.global_step} {self.train_s:.1f} s held out {rate:.2f}", flush=True)
                self.last_eval = self.train_s
                if rate >= max(THRESHOLDS):
                    control.should_training_stop = True
            if self.train_s >= args.budget:
                control.should_training_stop = True
            self.mark = time.monotonic()

    clock = Clock()
    config = GRPOConfig(
        output_dir=str(work / f"trl-out-s{seed}"), seed=seed, use_cpu=True, bf16=False, report_to="none",
        save_strategy="no", logging_steps=10, disable_tqdm=True, max_steps=100_000,
        per_device_train_batch_size=GROUP * PROMPTS_PER_STEP, num_generations=GROUP,
        max_completion_length=MAX_TOKENS, temperature=1.0, beta=0.0,
        learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
    )  # fmt: skip
    dataset = Dataset.from_dict({"prompt": [p.prompt for p in train]})
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=config, train_dataset=dataset,
                          processing_class=tok, callbacks=[clock])  # fmt: skip
    try:
        trainer.train()
    finally:
        sandbox.close()
    return clock.evals


def _reward_config():
    from launch.demo_config import demo_run_config

    return demo_run_config().reward


def geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--budget", type=float, default=120.0, help="seconds of training per run")
    ap.add_argument("--eval-every", type=float, default=3.0, help="seconds of training between evaluations")
    ap.add_argument("--heldout", type=int, default=100)
    ap.add_argument("--out", type=Path, default=None, help="where the runs and results.json go (default: a temp dir)")
    args = ap.parse_args()
    work = args.out or Path(tempfile.mkdtemp(prefix="vs-trl-"))
    work.mkdir(parents=True, exist_ok=True)
    results = {}
    for seed in args.seeds:
        model_dir, conveyor = conveyor_run(seed, args, work)
        trl = trl_run(seed, model_dir, args, work)
        results[seed] = {"conveyor": conveyor, "trl": trl}
        (work / "results.json").write_text(json.dumps(results, indent=1))
        for th in THRESHOLDS:
            c, t = time_to(conveyor, th), time_to(trl, th)
            seconds = lambda x: f"{x:.1f} s" if x is not None else f"not reached in {args.budget:.0f} s"  # noqa: E731
            print(f"seed {seed} held out {th}: conveyor {seconds(c)}, trl {seconds(t)}", flush=True)
    for th in THRESHOLDS:
        pairs = [(time_to(r["trl"], th), time_to(r["conveyor"], th)) for r in results.values()]
        both = [t / c for t, c in pairs if t is not None and c is not None and c > 0]
        censored = {"conveyor": sum(c is None for _, c in pairs), "trl": sum(t is None for t, _ in pairs)}
        ratio = f"{geomean(both):.2f}x over {len(both)} seeds" if both else "no seed reached it in both"
        print(f"held out {th}: trl/conveyor time {ratio}; not reached: {censored}")
    final = [t / c for t, c in ((time_to(r["trl"], 0.9), time_to(r["conveyor"], 0.9)) for r in results.values())
             if t is not None and c is not None and c > 0]  # fmt: skip
    if not final:
        print("no seed reached held out 0.9 in both runs", file=sys.stderr)
        sys.exit(1)
    print(f"FIGURE conveyor_vs_trl_speedup {geomean(final):.2f} x")


if __name__ == "__main__":
    main()
