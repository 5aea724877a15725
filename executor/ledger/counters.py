"""The counters the database keeps as the ledger moves (`Counter`, `RunStepCount`, migration
0018's triggers): reading them, and folding the rows of database sessions that have ended.

Each session adds to rows of its own (shard = its server process id), so the rows of a
metric grow with the sessions that ever wrote, not with the ledger; `fold` moves the rows of
sessions gone into shard 0, a few rows a metric, from the sweeper.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from django.db import connection, transaction
from django.db.models import Sum

from executor.ledger.records import Counter, RunStepCount

# Rows of sessions that have ended, locked without waiting (a session whose process id was
# given again to a new one may be writing its row: it is folded at a later sweep).
_FOLD_POSTGRESQL = {
    Counter: (
        "WITH gone AS (DELETE FROM executor_counter WHERE id IN ("
        " SELECT id FROM executor_counter WHERE shard <> 0"
        " AND shard NOT IN (SELECT pid FROM pg_stat_activity WHERE pid IS NOT NULL)"
        " FOR UPDATE SKIP LOCKED) RETURNING name, label_a, label_b, value)"
        " INSERT INTO executor_counter AS c (name, label_a, label_b, shard, value)"
        " SELECT name, label_a, label_b, 0, sum(value) FROM gone"
        " GROUP BY name, label_a, label_b ORDER BY name, label_a, label_b"
        " ON CONFLICT (name, label_a, label_b, shard)"
        " DO UPDATE SET value = c.value + EXCLUDED.value"
    ),
    RunStepCount: (
        "WITH gone AS (DELETE FROM executor_runstepcount WHERE id IN ("
        " SELECT id FROM executor_runstepcount WHERE shard <> 0"
        " AND shard NOT IN (SELECT pid FROM pg_stat_activity WHERE pid IS NOT NULL)"
        " FOR UPDATE SKIP LOCKED) RETURNING run_id, state, count)"
        " INSERT INTO executor_runstepcount AS c (run_id, state, shard, count)"
        " SELECT run_id, state, 0, sum(count) FROM gone"
        " GROUP BY run_id, state ORDER BY run_id, state"
        " ON CONFLICT (run_id, state, shard) DO UPDATE SET count = c.count + EXCLUDED.count"
    ),
}


def fold() -> int:
    """Folds the counter rows of ended sessions into shard 0 (PostgreSQL; SQLite writes
    shard 0 only). Returns how many rows were folded away."""
    if connection.vendor != "postgresql":
        return 0
    folded = 0
    with transaction.atomic(), connection.cursor() as cursor:
        for sql in _FOLD_POSTGRESQL.values():
            cursor.execute(sql)
            folded += max(cursor.rowcount, 0)
    return folded


def counter_values() -> dict[tuple[str, str, str], float]:
    """Every counter's value (its rows summed), by (name, label_a, label_b): one query."""
    rows = (
        Counter.objects.order_by()
        .values_list("name", "label_a", "label_b")
        .annotate(total=Sum("value"))
    )
    return {(name, a, b): total for name, a, b, total in rows}


def run_state_counts(run_ids: Iterable[Any]) -> dict[Any, dict[str, int]]:
    """Steps per state of each run of `run_ids`: one query over those runs' counter rows."""
    rows = (
        RunStepCount.objects.filter(run_id__in=list(run_ids))
        .order_by()
        .values_list("run_id", "state")
        .annotate(total=Sum("count"))
    )
    counts: dict[Any, dict[str, int]] = {}
    for run_id, state, total in rows:
        if total:
            counts.setdefault(run_id, {})[state] = int(total)
    return counts
