"""structlog setup: readable lines on a terminal, JSON lines otherwise (journald, files, CI)."""

from __future__ import annotations

import logging
import os
import sys

import structlog


def setup(level: str | None = None, *, process: str = "") -> None:
    """Configure structlog once per process. `process` (router, worker-0...) is bound on every line."""
    level_name = (level or os.environ.get("KVROUTE_LOG_LEVEL") or "info").upper()
    lvl = getattr(logging, level_name, logging.INFO)
    json_logs = os.environ.get("KVROUTE_LOG_FORMAT", "auto")
    use_json = json_logs == "json" or (json_logs == "auto" and not sys.stderr.isatty())
    processors: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=False),
    ]
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if use_json else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    if use_json:
        processors.append(structlog.processors.format_exc_info)
    structlog.configure(
        processors=[*processors, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    if process:
        structlog.contextvars.bind_contextvars(process=process)


def get(name: str) -> structlog.typing.FilteringBoundLogger:
    return structlog.get_logger(name)
