"""A ledger grown fast (PostgreSQL): rows inserted in bulk by `generate_series`, as a year
of agents would have left them, and the plans PostgreSQL makes over them.

The tables are left un-analyzed, as they are after a burst on a server whose autovacuum
has not come by yet (this machine's runs with autovacuum off): what a plan does there
must not depend on statistics.
"""

from __future__ import annotations

import json
from typing import Any

from django.db import connection

from executor.ledger.records import Agent, Run
from executor.ledger.states import State

HOT_TABLES = ("executor_step", "executor_attempt", "executor_event")


def grow_steps(run: Run, count: int, *, state: State = State.COMPLETED, start: int = 0) -> None:
    """`count` steps of `echo` in `run` (positions after `start`), in `state`, with one
    closed attempt and one event each."""
    failure = "transient" if state in (State.FAILED, State.DEAD) else ""
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO executor_step (id, position, key, input, input_hash, input_summary,"
            " depends_on, operation_id, state, version, head_hash, lease_owner, fence,"
            " attempt_count, external_id, failure_class, failure_message, created_at,"
            " updated_at, run_id, tool, state_since, not_before)"
            " SELECT gen_random_uuid(), %s + g, 'grown-' || (%s + g), '{}'::jsonb, '', '',"
            " '[]'::jsonb, gen_random_uuid(), %s, 2, '', '', 1, 1, '', %s, '',"
            " now() - interval '1 hour', now(), %s, 'echo', now(), now() - interval '1 hour'"
            " FROM generate_series(1, %s) g",
            [start, start, state.value, failure, run.pk, count],
        )
        cursor.execute(
            "INSERT INTO executor_attempt (number, fence, worker, phase, error_class,"
            " error_message, cost, fenced_out_write, claimed_at, submitted_at, finished_at,"
            " step_id)"
            " SELECT 1, 1, 'grown', 'responded', '', '', 0, '', now(), now(), now(), s.id"
            " FROM executor_step s WHERE s.run_id = %s AND s.position > %s",
            [run.pk, start],
        )
        cursor.execute(
            "INSERT INTO executor_event (seq, from_state, to_state, actor, reason, data,"
            " created_at, prev_hash, hash, run_id, step_id, format, step_digest)"
            " SELECT 1, '', s.state, 'grown', '', '{}'::jsonb, now(), '',"
            " decode(md5(s.id::text) || md5(s.id::text), 'hex'), s.run_id, s.id, 3, ''"
            " FROM executor_step s WHERE s.run_id = %s AND s.position > %s",
            [run.pk, start],
        )


def grow_runs(agent: Agent, count: int, *, status: str = "open") -> None:
    """`count` runs of `agent`, created a second apart (oldest first)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO executor_run (id, name, request_hash, status, pause_reason, used_calls,"
            " used_cost, version, created_at, updated_at, agent_id, workspace_id, seal)"
            " SELECT gen_random_uuid(), 'grown-' || g, '', %s, '', 0, 0, 1,"
            " now() - (%s - g) * interval '1 second', now(), %s, %s, ''"
            " FROM generate_series(1, %s) g",
            [status, count, agent.pk, agent.workspace_id, count],
        )


def plan(sql: str, params: Any = None, *, run: bool = False) -> dict[str, Any]:
    """PostgreSQL's plan for `sql` as its JSON tree; with `run`, run (EXPLAIN ANALYZE) with
    the rows each node met."""
    options = "ANALYZE, BUFFERS, TIMING OFF, FORMAT JSON" if run else "FORMAT JSON"
    with connection.cursor() as cursor:
        cursor.execute(f"EXPLAIN ({options}) {sql}", params)
        raw = cursor.fetchone()[0]
    found = raw if isinstance(raw, list) else json.loads(raw)
    return found[0]["Plan"]


def nodes(tree: dict[str, Any]) -> list[dict[str, Any]]:
    """Every node of a plan, depth first."""
    found = [tree]
    for child in tree.get("Plans", []):
        found += nodes(child)
    return found


def full_scans(tree: dict[str, Any]) -> list[str]:
    """The hot tables the plan reads whole (a sequential scan)."""
    return [
        node["Relation Name"]
        for node in nodes(tree)
        if node["Node Type"] == "Seq Scan" and node.get("Relation Name") in HOT_TABLES
    ]


def rows_read(tree: dict[str, Any]) -> dict[str, int]:
    """How many rows of each hot table a run plan (`plan(..., run=True)`) met: those it
    returned and those its filters threw away, over every loop."""
    found: dict[str, int] = {}
    for node in nodes(tree):
        table = node.get("Relation Name")
        if table not in HOT_TABLES:
            continue
        met = (
            node.get("Actual Rows", 0)
            + node.get("Rows Removed by Filter", 0)
            + node.get("Rows Removed by Index Recheck", 0)
        )
        found[table] = found.get(table, 0) + met * node.get("Actual Loops", 1)
    return found


def describe(tree: dict[str, Any], depth: int = 0) -> str:
    """The plan as indented lines, for an assertion's message."""
    line = "  " * depth + tree["Node Type"]
    if "Relation Name" in tree:
        line += f" on {tree['Relation Name']}"
    if "Index Name" in tree:
        line += f" using {tree['Index Name']}"
    if "Actual Rows" in tree:
        line += f" (rows {tree['Actual Rows']} x {tree.get('Actual Loops', 1)})"
    return "\n".join([line, *(describe(child, depth + 1) for child in tree.get("Plans", []))])
