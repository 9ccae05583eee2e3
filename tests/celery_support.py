"""Helpers for tests that run Celery reward workers as real processes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import yaml
from conftest import service_unavailable


def reachable(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def broker_section(kind: str, redis_url: str) -> dict:
    if kind == "redis":
        # Redelivery of a dead worker's task after 12 s: above the hard time limit below.
        return {"type": "redis", "url": redis_url, "visibility_timeout_s": 12}
    if not reachable(5672):
        service_unavailable("the machine's RabbitMQ on port 5672 is not running")
    return {"type": "rabbitmq", "url": "amqp://guest:guest@127.0.0.1:5672//"}


def write_config(path: Path, kind: str, redis_url: str, queue: str, tracing: dict | None = None, **reward) -> Path:
    cfg = {
        "run_id": queue.replace(".", "-"),
        "celery": broker_section(kind, redis_url),
        "reward": {"timeout_s": 6, "soft_time_limit_s": 8, "hard_time_limit_s": 10, "queue": queue, **reward},
        "logging": {"level": "info", "format": "json"},
        **({"tracing": tracing} if tracing else {}),
    }
    path.write_text(yaml.safe_dump(cfg))
    return path


class Worker:
    """``conveyor serve reward-worker`` in its own session (so kill -9 takes the whole pool)."""

    def __init__(self, config: Path, name: str, log_dir: Path, *, queue: str | None = None) -> None:
        self.log = log_dir / f"{name}.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "launch.cli.main", "serve", "reward-worker", "--config", str(config),
             "--concurrency", "1", "--hostname", f"{name}@%h", *(["--queue", queue] if queue else [])],
            stdout=self.log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip

    def wait_for(self, needle: str, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if needle in self.log.read_text(errors="replace"):
                return
            if self.proc.poll() is not None:
                raise AssertionError(f"worker exited {self.proc.returncode}:\n{self.log.read_text()[-2000:]}")
            time.sleep(0.1)
        raise AssertionError(f"{needle!r} not in the worker's log after {timeout_s}s:\n{self.log.read_text()[-2000:]}")

    def kill9(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill9()
