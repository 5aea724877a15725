"""Tools defined by rows of a model (HTTP tools, MCP upstreams' tools), registered in every
process from the rows as they are, and again whenever they change: a count and the newest
`updated_at` tell, asked at most every EXECUTOR_TOOL_REFRESH_SECONDS unless forced."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from django.conf import settings
from django.db import DatabaseError, models
from django.db.models import Count, Max


class RowSource[M: models.Model]:
    def __init__(self, model: type[M], install: Callable[[list[M]], None]) -> None:
        self._model = model
        self._install = install
        self._lock = threading.Lock()
        self._generation: tuple[int, Any] | None = None
        self._checked_at = 0.0

    def refresh(self, *, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._checked_at < settings.EXECUTOR_TOOL_REFRESH_SECONDS:
            return
        with self._lock:
            self._checked_at = now
            manager = self._model._default_manager
            try:
                row = manager.aggregate(n=Count("pk"), latest=Max("updated_at"))
                generation = (row["n"], row["latest"])
                if generation == self._generation and not force:
                    return
                rows = list(manager.all())
            except (DatabaseError, RuntimeError):
                # Not migrated yet, no database here, or none allowed (a test without one):
                # the registry keeps what it had, and code's tools are unaffected.
                return
            self._install(rows)
            self._generation = generation
