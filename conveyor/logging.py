"""The one structlog setup, called from entry points only (never at import).

Services log JSON lines; the CLI logs to a pretty console. Context bound with
``structlog.contextvars.bind_contextvars(run_id=..., task_id=...)`` appears
on every line logged in that task.
"""

from __future__ import annotations

import logging
import socket
import sys
from typing import Literal, TextIO, cast

import structlog
from structlog.typing import Processor


def configure_logging(
    service: str,
    fmt: Literal["json", "console", "auto"] = "auto",
    level: str = "info",
    **context: str,
) -> None:
    if fmt == "auto":
        fmt = "console" if sys.stderr.isatty() else "json"
    lvl = logging.getLevelName(level.upper())
    renderer = structlog.processors.JSONRenderer() if fmt == "json" else structlog.dev.ConsoleRenderer()
    # The process's own fields on every line, from every thread (context variables are per thread
    # and per task: a library's thread, e.g. botocore's transfer threads, would not see them).
    fields = {"service": service, "host": socket.gethostname(), **context}
    shared: list[Processor] = [
        _with_fields(fields),
        _with_trace,
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    # Libraries log through the standard library (aiokafka, botocore, celery, uvicorn): their lines
    # go through the same renderer, so a JSON log stream stays JSON lines, with the logger's name.
    handler = logging.StreamHandler(_STDERR)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name, structlog.stdlib.ExtraAdder()],
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.format_exc_info,
                renderer,
            ],
        )
    )
    logging.basicConfig(handlers=[handler], level=lvl, force=True)
    structlog.configure(
        processors=[
            *shared,
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=cast(TextIO, _STDERR)),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.clear_contextvars()


class _CurrentStderr:
    """Whatever ``sys.stderr`` is when a line is written, not when logging was configured: a progress
    bar (rich) swaps it for a proxy that prints lines above the bar, so log lines and the bar do not
    interleave; so does a test's capture."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()

    def isatty(self) -> bool:
        return sys.stderr.isatty()


_STDERR = _CurrentStderr()


def _with_trace(_logger, _name, event_dict):
    """The trace and span a line was logged under (a traced task's work), as the trace backend shows them."""
    from opentelemetry import trace

    ctx = trace.get_current_span().get_span_context()
    if ctx.is_valid:
        event_dict.setdefault("trace_id", format(ctx.trace_id, "032x"))
        event_dict.setdefault("span_id", format(ctx.span_id, "016x"))
    return event_dict


def _with_fields(fields: dict[str, str]) -> Processor:
    def add(_logger, _name, event_dict):
        for key, value in fields.items():
            event_dict.setdefault(key, value)
        return event_dict

    return add
