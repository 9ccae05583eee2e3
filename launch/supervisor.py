"""``conveyor run CONFIG --stack local``: every role as its own process.

The run's config is resolved against the local stack (the broker, S3 and
Redis it started or found) and written to ``runs/<run>/run.yaml``; each role
is started as ``conveyor serve <role> --config runs/<run>/run.yaml`` with its
log under ``runs/<run>/logs/``. The supervisor restarts a role that exits
unexpectedly (with backoff), which is what a Deployment does in Kubernetes;
roles meet only through topics, Celery queues and the object store, so a
restarted role picks up where the group's committed offsets (or, for the
learner, its checkpoint) say.

Scaling while a run is going: start more ``conveyor serve rollout-worker``
or ``conveyor serve reward-worker`` processes with the same ``run.yaml``
(anywhere that reaches the stack), or stop some; consumer groups and the
Celery queue rebalance the work.

Stopping drains front to back: producer, rollout workers, reward bridge
(scores what was generated), reward workers, learner (final checkpoint),
storage sink (stores everything scored).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import structlog
import yaml

from conveyor.config import RunConfig

log = structlog.get_logger(__name__)
# The evaluator stops after the learner: the policy the learner publishes at its stop is the last one
# it may evaluate.
STOP_ORDER = ["producer", "rollout-worker", "reward-bridge", "reward-worker", "learner", "evaluator", "storage-sink"]
REFUSED = 2  # a role's exit code for a config or input it refuses at start: restarting cannot help


def resolve_for_stack(cfg: RunConfig, endpoints: dict[str, str], bucket: str = "conveyor") -> dict:
    """The config as a dict, with transport, object store and Celery broker pointed at the local stack."""
    from conveyor.backend_config import REVEAL_SECRETS
    from launch.stack.components import LOCAL_S3_ACCESS_KEY, LOCAL_S3_SECRET_KEY

    data = cfg.model_dump(mode="json", context={REVEAL_SECRETS: True})  # a child's config: secrets in clear
    # The local broker serves plaintext only: the run's own security settings do not apply to it.
    transport = {k: v for k, v in data["transport"].items() if k in _kafka_fields() and not k.startswith(("ssl_", "sasl_"))}
    transport.update(type="kafka", bootstrap_servers=endpoints["kafka"], security_protocol="PLAINTEXT")
    data["transport"] = transport
    data["object_store"] = {"type": "s3", "endpoint_url": endpoints["s3"], "bucket": bucket,
                            "access_key_id": LOCAL_S3_ACCESS_KEY, "secret_access_key": LOCAL_S3_SECRET_KEY}  # fmt: skip
    if "redis" in endpoints and cfg.celery.type == "local":
        hard = cfg.reward.hard_time_limit_s
        data["celery"] = {"type": "redis", "url": endpoints["redis"], "visibility_timeout_s": int(max(60, hard * 2))}
    return data


def _kafka_fields() -> set[str]:
    from conveyor.config import KafkaTransportConfig

    return set(KafkaTransportConfig.model_fields)


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM it (a clean drain) if the supervisor dies, even by SIGKILL."""
    import ctypes

    ctypes.CDLL(None).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG


@dataclass
class Role:
    name: str
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen | None = None
    starts: int = 0
    restarts: int = 0
    next_start_at: float = 0.0
    backoff_s: float = 0.5
    stopping: bool = False
    done: bool = False
    history: list[int] = field(default_factory=list)  # exit codes
    env: dict[str, str] = field(default_factory=dict)  # over the supervisor's own environment

    def start(self) -> None:
        self.proc = subprocess.Popen(
            self.argv,
            env={**os.environ, **self.env} if self.env else None,
            stdout=self.log_path.open("a"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        self.starts += 1

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None


class Supervisor:
    def __init__(self, run_dir: Path, config_path: Path, model_dir: Path, *, rollout_workers: int = 1, reward_workers: int = 1,
                 tokenizer_dir: Path | None = None, threads: int = 1, evaluator: bool = False,
                 metrics_port_base: int | None = None) -> None:  # fmt: skip
        """``metrics_port_base``: each role serves Prometheus metrics on its own port from there
        (``metrics_ports``: role -> port), overriding the config's ``metrics.port``, which on one
        host every role would try to bind."""
        self.run_dir = run_dir
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        serve = [sys.executable, "-m", "launch.cli.main", "serve"]
        cfg = ["--config", str(config_path)]
        tok = str(tokenizer_dir or model_dir)
        specs: list[tuple[str, list[str]]] = [
            ("storage-sink", [*serve, "storage-sink", *cfg]),
            ("learner", [*serve, "learner", *cfg, "--model", str(model_dir), "--run-dir", str(run_dir), "--threads", str(threads)]),
            *[(f"reward-worker-{i}", [*serve, "reward-worker", *cfg, "--concurrency", "1", "--hostname", f"reward{i}@%h"])
              for i in range(reward_workers)],
            ("reward-bridge", [*serve, "reward-bridge", *cfg, "--tokenizer", tok]),
            *[(f"rollout-worker-{i}", [*serve, "rollout-worker", *cfg, "--model", str(model_dir), "--threads", str(threads),
                                       "--seed", str(i)]) for i in range(rollout_workers)],
            ("producer", [*serve, "producer", *cfg]),
            *([("evaluator", [*serve, "evaluator", *cfg, "--model", str(model_dir), "--run-dir", str(run_dir)])] if evaluator else []),
        ]  # fmt: skip
        self.metrics_ports = (
            {} if metrics_port_base is None else {name: metrics_port_base + i for i, (name, _) in enumerate(specs)}
        )
        self.roles = {
            name: Role(name, argv, run_dir / "logs" / f"{name}.log",
                       env={"CONVEYOR_METRICS__PORT": str(self.metrics_ports[name])} if name in self.metrics_ports else {})
            for name, argv in specs
        }  # fmt: skip

    def start(self) -> None:
        for role in self.roles.values():
            role.start()
            log.info("role_started", role=role.name, pid=role.proc.pid)

    def tick(self) -> None:
        """Restart roles that exited without being asked to."""
        now = time.monotonic()
        for role in self.roles.values():
            if role.stopping or role.proc is None:
                continue
            code = role.proc.poll()
            if code is None or role.done:
                continue
            if code == 0 and role.name == "producer":  # its suite ran out: finished, not crashed
                role.done = True
                log.info("role_finished", role=role.name)
                continue
            if code == REFUSED:
                role.done = True
                role.history.append(code)
                log.error("role_refused_to_start", role=role.name, exit_code=code, log=str(role.log_path))
                continue
            if role.next_start_at == 0.0:
                role.history.append(code)
                role.next_start_at = now + role.backoff_s
                role.backoff_s = min(role.backoff_s * 2, 10.0)
                log.warning("role_exited", role=role.name, exit_code=code, restart_in_s=round(role.next_start_at - now, 2))
            elif now >= role.next_start_at:
                role.start()
                role.restarts += 1
                role.next_start_at = 0.0
                log.info("role_restarted", role=role.name, pid=role.proc.pid, restarts=role.restarts)
        for role in self.roles.values():  # a role that stayed up a while earns its backoff back
            if role.pid and role.next_start_at == 0.0 and role.backoff_s > 0.5:
                role.backoff_s = max(0.5, role.backoff_s / 2)

    def alive(self) -> dict[str, int | None]:
        return {name: role.pid for name, role in self.roles.items()}

    def stop(self, grace_s: float = 60.0) -> dict[str, int | None]:
        """SIGTERM role kinds front to back, waiting for each kind to drain and exit; a role still
        running after ``grace_s`` is killed with its whole process group."""
        codes: dict[str, int | None] = {}
        for kind in STOP_ORDER:
            group = [r for r in self.roles.values() if r.name == kind or r.name.startswith(kind + "-")]
            for r in group:
                r.stopping = True
                if r.proc is not None and r.proc.poll() is None:
                    # The role's process only, as Kubernetes signals a container's PID 1: its children
                    # are its own to stop. vLLM's engine process aborts every request in flight when it
                    # gets SIGTERM itself, and the worker's drain would then wait on them until killed.
                    os.kill(r.proc.pid, signal.SIGTERM)
            for r in group:
                if r.proc is None:
                    continue
                try:
                    codes[r.name] = r.proc.wait(grace_s)
                except subprocess.TimeoutExpired:
                    os.killpg(r.proc.pid, signal.SIGKILL)
                    codes[r.name] = r.proc.wait()
                    log.error("role_killed_after_grace", role=r.name)
        return codes


def write_run_config(run_dir: Path, data: dict) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "run.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    path.chmod(0o600)  # it holds the object store's credentials
    return path
