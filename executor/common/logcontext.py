"""Log lines an operator can search (issue 13): each carries the step, run, workspace and
attempt it is about, where there is one, and is one JSON object with LOG_FORMAT=json.

The engine and the API bind what they are working on (`bound`, `add`); a log record factory
copies it onto every record made meanwhile, whichever logger makes it (Django's request
log, Celery's task log, ours), so the formatters and any handler can use it.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any

from executor.common.redaction import redact, redact_text

FIELDS = ("step_id", "run_id", "workspace", "attempt", "agent", "worker")

_context: ContextVar[dict[str, Any] | None] = ContextVar("stepward_log_context", default=None)


@contextlib.contextmanager
def bound(**fields: Any) -> Iterator[None]:
    """Adds `fields` to every log record made inside the block (None values are left out)."""
    token = _context.set({**(_context.get() or {}), **_present(fields)})
    try:
        yield
    finally:
        _context.reset(token)


def add(**fields: Any) -> None:
    """Adds `fields` to the innermost `bound` block (a request's, a task's) until it ends."""
    current = _context.get()
    if current is not None:
        _context.set({**current, **_present(fields)})


def current() -> dict[str, Any]:
    return dict(_context.get() or {})


def _present(fields: dict[str, Any]) -> dict[str, Any]:
    return {name: str(value) for name, value in fields.items() if value not in (None, "")}


def install_record_factory() -> None:
    """Makes every log record carry the bound fields (once per process)."""
    previous = logging.getLogRecordFactory()
    if getattr(previous, "stepward", False):
        return

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        for name, value in (_context.get() or {}).items():
            if not hasattr(record, name):
                setattr(record, name, value)
        return record

    factory.stepward = True  # type: ignore[attr-defined]
    logging.setLogRecordFactory(factory)


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time, level, logger, message, the bound fields, any error."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                line[name] = value
        if record.exc_info:
            line["error"] = self.formatException(record.exc_info)
        return json.dumps(redact(line), ensure_ascii=False, default=str)


class PlainFormatter(logging.Formatter):
    """`LEVEL logger: message [step_id=… run_id=…]` for people reading a terminal."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        text = super().formatMessage(record)
        fields = " ".join(
            f"{name}={getattr(record, name)}" for name in FIELDS if hasattr(record, name)
        )
        return f"{text} [{fields}]" if fields else text

    def format(self, record: logging.LogRecord) -> str:
        """The line, traceback included, with every secret its shape gives away redacted:
        ours and our libraries' lines alike (DESIGN.md §15)."""
        return redact_text(super().format(record))
