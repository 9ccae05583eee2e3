"""Start, check and stop the local stack (``conveyor stack up|status|down``).

State lives under one directory (default ``.conveyor/stack``)::

    <state_dir>/stack.json        pids, ports and endpoints of what runs
    <state_dir>/logs/<name>.log   each component's stdout and stderr
    <state_dir>/data/<name>/      each component's data

``up`` refuses to start twice, refuses a port in use, and names a missing
binary; it returns only when every component answers a real protocol
request (Kafka metadata, S3 ListBuckets, Redis PING). Processes run in their
own session, so they outlive the CLI and are stopped as a process group.
``down`` sends SIGTERM, waits, then SIGKILL (SeaweedFS ignores SIGTERM for
a long time).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import socket
import subprocess
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from conveyor.runtime import pid_alive
from launch.stack.components import (
    ALL_COMPONENTS,
    BUILDERS,
    LOCAL_S3_ACCESS_KEY,
    LOCAL_S3_SECRET_KEY,
    BinaryMissing,
    Component,
    StackPorts,
    redis_component,
)


class StackError(RuntimeError):
    exit_code = 1


class AlreadyRunning(StackError):
    exit_code = 10


class PortInUse(StackError):
    exit_code = 11


class HealthCheckFailed(StackError):
    exit_code = 13


class ExitedDuringStartup(HealthCheckFailed):
    """The process died before it answered its health check."""


class NotRunning(StackError):
    exit_code = 14


__all__ = [
    "AlreadyRunning",
    "BinaryMissing",
    "ExitedDuringStartup",
    "HealthCheckFailed",
    "NotRunning",
    "PortInUse",
    "Stack",
    "StackError",
    "StackPorts",
    "default_state_dir",
    "ephemeral_port_range",
    "free_port_block",
    "in_ephemeral_range",
]


def default_state_dir() -> Path:
    return Path(os.environ.get("CONVEYOR_STACK_DIR", ".conveyor/stack")).resolve()


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def ephemeral_port_range() -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports (Linux; else its default)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def in_ephemeral_range(base: int, n: int, port_range: tuple[int, int] | None = None) -> bool:
    """Whether any of ports ``base .. base+n-1`` lies in the ephemeral range."""
    low, high = port_range or ephemeral_port_range()
    return base <= high and base + n - 1 >= low


def free_port_block(n: int = 10, start: int = 20000, stop: int = 32000) -> int:
    """The first port of ``n`` consecutive free loopback ports, outside the ephemeral range.

    A server port inside the range the kernel draws outgoing connections'
    local ports from can be taken while its server is down: any outgoing
    connection on the machine may get P as its local port, and a client that
    keeps reconnecting to 127.0.0.1:P gets it once in a few ten thousand
    attempts and connects to itself (TCP simultaneous open); the restarted
    server then cannot bind P. So the block is drawn from ``[start, stop)``
    less that range.
    """
    low, high = ephemeral_port_range()
    candidates = [b for b in range(start, stop - n) if not in_ephemeral_range(b, n, (low, high))]
    if not candidates:  # a machine whose ephemeral range covers nearly everything: better than no stack
        warnings.warn(f"no room for {n} ports in [{start}, {stop}) outside the ephemeral range {low}-{high}; "
                      "a component restarted after a kill may find its port taken", stacklevel=2)  # fmt: skip
        candidates = list(range(max(start, 1024), 65535 - n))
    for _ in range(200):
        base = random.choice(candidates)
        ok = True
        for p in range(base, base + n):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError("no free port block")


# --------------------------------------------------------------------------
# health checks: a real request in each protocol


def check_kafka(endpoint: str, timeout_s: float = 3.0) -> None:
    async def probe() -> None:
        from aiokafka.admin import AIOKafkaAdminClient

        admin = AIOKafkaAdminClient(bootstrap_servers=endpoint, request_timeout_ms=int(timeout_s * 1000))
        try:
            await asyncio.wait_for(admin.start(), timeout_s)
            await asyncio.wait_for(admin.list_topics(), timeout_s)  # a metadata request
        finally:
            await admin.close()

    asyncio.run(probe())


def check_s3(endpoint: str, timeout_s: float = 3.0) -> None:
    import boto3
    from botocore.config import Config

    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id=LOCAL_S3_ACCESS_KEY,
        aws_secret_access_key=LOCAL_S3_SECRET_KEY,
        config=Config(connect_timeout=timeout_s, read_timeout=timeout_s, retries={"max_attempts": 1}),
    )
    client.list_buckets()


def check_redis(endpoint: str, timeout_s: float = 3.0) -> None:
    import redis

    client = redis.Redis.from_url(endpoint, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    try:
        if not client.ping():
            raise RuntimeError("PING did not return PONG")
    except redis.AuthenticationError:
        return  # it answered, asking for credentials: serving (a server with users, and none given here)
    finally:
        client.close()


HEALTH_CHECKS = {"kafka": check_kafka, "s3": check_s3, "redis": check_redis}


@dataclass
class RunningComponent:
    name: str
    pid: int
    endpoint: str
    ports: list[int]
    log: str
    argv: list[str]


class Stack:
    def __init__(
        self,
        state_dir: Path | str | None = None,
        ports: StackPorts | None = None,
        *,
        redis_users: Mapping[str, str] | None = None,
    ) -> None:
        """``redis_users`` (name -> password): the Redis-compatible server admits only them (see
        ``redis_component``); ``up`` and ``restart`` of this object both apply it."""
        self.state_dir = Path(state_dir).resolve() if state_dir else default_state_dir()
        self.ports = ports or StackPorts()
        self.redis_users = dict(redis_users) if redis_users is not None else None
        self.restart_failures: list[str] = []  # what each start-up crash in ``restart`` printed

    def _spec(self, name: str) -> Component:
        data_dir = self.state_dir / "data" / name
        if name == "redis" and self.redis_users is not None:
            return redis_component(self.ports, data_dir, self.redis_users)
        return BUILDERS[name](self.ports, data_dir)  # may raise BinaryMissing

    @property
    def state_file(self) -> Path:
        return self.state_dir / "stack.json"

    # -- state
    def read_state(self) -> dict[str, RunningComponent]:
        try:
            raw = json.loads(self.state_file.read_text())
        except FileNotFoundError:
            return {}
        return {name: RunningComponent(**c) for name, c in raw.get("components", {}).items()}

    def _write_state(self, running: dict[str, RunningComponent]) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"components": {n: asdict(c) for n, c in running.items()}}, indent=2))
        os.replace(tmp, self.state_file)

    def endpoints(self) -> dict[str, str]:
        return {name: c.endpoint for name, c in self.read_state().items()}

    # -- up
    def up(self, components: Sequence[str] = ALL_COMPONENTS, timeout_s: float = 60.0) -> dict[str, RunningComponent]:
        unknown = [c for c in components if c not in BUILDERS]
        if unknown:
            raise StackError(f"unknown component(s) {', '.join(unknown)}; known: {', '.join(BUILDERS)}")
        existing = {n: c for n, c in self.read_state().items() if pid_alive(c.pid)}
        if existing:
            listing = ", ".join(f"{n} (pid {c.pid})" for n, c in existing.items())
            raise AlreadyRunning(
                f"the stack in {self.state_dir} is already running: {listing}; "
                "run `conveyor stack down` first, or use another --state-dir"
            )
        specs = [self._spec(name) for name in components]
        for spec in specs:
            busy = [p for p in spec.ports if not port_free(p)]
            if busy:
                raise PortInUse(
                    f"cannot start {spec.name}: port(s) {', '.join(map(str, busy))} on 127.0.0.1 already in use; "
                    "choose other ports (--base-port) or stop what holds them"
                )
        running: dict[str, RunningComponent] = {}
        try:
            for spec in specs:
                running[spec.name] = self._spawn(spec)
                self._write_state(running)
            deadline = time.monotonic() + timeout_s
            for spec in specs:
                self._wait_healthy(running[spec.name], deadline)
        except BaseException:
            self._stop(running)
            self.state_file.unlink(missing_ok=True)
            raise
        return running

    def _spawn(self, spec: Component) -> RunningComponent:
        (self.state_dir / "data" / spec.name).mkdir(parents=True, exist_ok=True)
        log_dir = self.state_dir / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / f"{spec.name}.log"
        with open(log_path, "ab") as log_fh:
            proc = subprocess.Popen(
                spec.argv,
                stdin=subprocess.DEVNULL,
                stdout=log_fh,
                stderr=subprocess.STDOUT,
                cwd=self.state_dir / "data" / spec.name,
                env={**os.environ, **spec.env},
                start_new_session=True,
            )
        return RunningComponent(spec.name, proc.pid, spec.endpoint, spec.ports, str(log_path), spec.argv)

    def _wait_healthy(self, comp: RunningComponent, deadline: float) -> None:
        check = HEALTH_CHECKS[comp.name]
        last_error = "no attempt"
        while time.monotonic() < deadline:
            if not pid_alive(comp.pid):
                raise ExitedDuringStartup(f"{comp.name} exited during start-up; last lines of {comp.log}:\n{_tail(comp.log)}")
            try:
                check(comp.endpoint, timeout_s=2.0)
                return
            except Exception as exc:  # noqa: BLE001 - any failure means "not yet"
                last_error = f"{type(exc).__name__}: {exc}"
            time.sleep(0.2)
        raise HealthCheckFailed(
            f"{comp.name} did not answer its health check at {comp.endpoint} in time ({last_error}); "
            f"last lines of {comp.log}:\n{_tail(comp.log)}"
        )

    # -- status
    def status(self) -> dict[str, dict[str, object]]:
        out: dict[str, dict[str, object]] = {}
        for name, comp in self.read_state().items():
            alive = pid_alive(comp.pid)
            error = _health_error(comp, timeout_s=2.0) if alive else "not running"
            out[name] = {"pid": comp.pid, "alive": alive, "healthy": error is None, "endpoint": comp.endpoint,
                         "error": error if alive else None}  # fmt: skip
        return out

    # -- down
    def down(self, grace_s: float = 10.0) -> list[str]:
        running = self.read_state()
        if not running:
            raise NotRunning(f"no stack is recorded in {self.state_dir}")
        stopped = self._stop(running, grace_s)
        self.state_file.unlink(missing_ok=True)
        return stopped

    def _stop(self, running: dict[str, RunningComponent], grace_s: float = 10.0) -> list[str]:
        for comp in running.values():
            _signal_group(comp.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(pid_alive(c.pid) for c in running.values()):
            _reap()
            time.sleep(0.1)
        for comp in running.values():
            if pid_alive(comp.pid):
                _signal_group(comp.pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(pid_alive(c.pid) for c in running.values()):
            _reap()
            time.sleep(0.05)
        return list(running)

    def kill(self, name: str) -> None:
        """SIGKILL one component (chaos tests)."""
        comp = self.read_state()[name]
        _signal_group(comp.pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and pid_alive(comp.pid):
            _reap()
            time.sleep(0.05)

    def restart(self, name: str, timeout_s: float = 60.0, attempts: int = 3) -> RunningComponent:
        """Start one component again on the same ports (after ``kill``).

        A process that dies during start-up is started again, up to
        ``attempts`` times within ``timeout_s``, as a service manager would
        (a server killed mid-write can fail its first start on what it left);
        each crash is kept in ``restart_failures`` with the end of its log.
        """
        running = self.read_state()
        comp = running[name]
        if pid_alive(comp.pid):
            raise AlreadyRunning(f"{name} (pid {comp.pid}) is still running")
        spec = self._spec(name)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(not port_free(p) for p in spec.ports):
            time.sleep(0.2)
        busy = [p for p in spec.ports if not port_free(p)]
        if busy:
            raise PortInUse(f"cannot restart {name}: port(s) {', '.join(map(str, busy))} still in use after {timeout_s:.0f} s")
        for attempt in range(1, attempts + 1):
            running[name] = self._spawn(spec)
            self._write_state(running)
            try:
                self._wait_healthy(running[name], deadline)
                return running[name]
            except ExitedDuringStartup as exc:
                self.restart_failures.append(str(exc))
                if attempt == attempts or time.monotonic() >= deadline:
                    raise
        raise AssertionError("unreachable")

    def ensure_healthy(self, name: str, timeout_s: float = 90.0) -> bool:
        """Restart ``name`` unless it answers its health check; True when it had to.

        For test fixtures: one failed chaos test must not leave the shared
        stack down for every test after it.
        """
        comp = self.read_state()[name]
        if pid_alive(comp.pid) and _health_error(comp, timeout_s=5.0) is None:
            return False
        self.kill(name)
        self.restart(name, timeout_s)
        return True


def _health_error(comp: RunningComponent, timeout_s: float) -> str | None:
    """None when ``comp`` answers its protocol's health check, else why not."""
    try:
        HEALTH_CHECKS[comp.name](comp.endpoint, timeout_s=timeout_s)
    except Exception as exc:  # noqa: BLE001 - any failure means "not healthy"
        return f"{type(exc).__name__}: {exc}"
    return None


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _reap() -> None:
    """Collect exited children of this process (when ``up`` and ``down`` run in one process)."""
    try:
        while True:
            pid, _ = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                return
    except ChildProcessError:
        return


_CRASH_MARKERS = re.compile(r"^(panic: |fatal error: |F\d{4} )")


def _tail(path: str, lines: int = 20) -> str:
    """The last lines of a log, led by the line that says why a Go server died.

    A Go crash ends with a goroutine dump that pushes its reason (``panic:``,
    ``fatal error:``, a glog ``F`` line) far above the last lines.
    """
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 256 * 1024))
            text = fh.read().decode(errors="replace").splitlines()
    except OSError:
        return "<no log>"
    last = text[-lines:]
    reasons = [line for line in text[:-lines] if _CRASH_MARKERS.match(line)]
    return "\n".join([*reasons[-3:], "...", *last] if reasons else last)
