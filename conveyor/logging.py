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
    """Whatever ``sys.stderr`` is when a line is written, not when logging was set up: a progress
    bar that takes over the terminal (rich redirects ``sys.stderr``) prints log lines above itself
    instead of being torn by them."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


_STDERR = _CurrentStderr()


def _with_fields(fields: dict[str, str]) -> Processor:
    def add(_logger, _name, event_dict):
        for key, value in fields.items():
            event_dict.setdefault(key, value)
        return event_dict

    return add
