"""System checks of the database the ledger lives in (`manage.py check --deploy`)."""

from __future__ import annotations

from typing import Any

from django.core.checks import CheckMessage, Warning, register
from django.db import DatabaseError, connection


@register("stepward", deploy=True)
def autovacuum_on(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Warns when the PostgreSQL server's autovacuum is off: the tables updated at every
    move of the ledger (steps, attempts, counters) then keep every dead row, and each
    claim, page and scrape wades through them (docs/operations.md)."""
    if connection.vendor != "postgresql":
        return []
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT current_setting('autovacuum'), current_setting('track_counts')")
            autovacuum, track_counts = cursor.fetchone()
    except DatabaseError:
        return []  # an unreachable database is migrate's and the web's to report
    if autovacuum == "on" and track_counts == "on":
        return []
    return [
        Warning(
            "PostgreSQL's autovacuum is off on this server"
            + ("" if track_counts == "on" else " (track_counts is off)")
            + ": the ledger's hot tables keep every dead row and their statistics go stale.",
            hint="Set autovacuum = on and track_counts = on in postgresql.conf (the "
            "defaults); the per-table thresholds Stepward sets rely on them. See "
            "docs/operations.md.",
            id="stepward.W001",
        )
    ]
