"""Counters the ledger keeps as it moves (API.md "For operators: metrics", issue 25.1).

Triggers on steps and attempts add to `Counter` and `RunStepCount` in the transaction of
the write that moves them, whichever code writes (the engine's bulk statements, a reviewer's
decision, a test's `update`): a scrape and the runs list read a few small rows instead of
every step. On PostgreSQL they are statement triggers over the statement's changed rows (one
upsert per metric and label for a batch of 500 moves), each session writing rows of its own
(`pg_backend_pid()`) so that workers never wait on one another's counters; on SQLite, row
triggers into shard 0.

The step_seconds buckets are written here as SQL: executor/surfaces/metrics.py's
STEP_SECONDS_BUCKETS must be the same (tests/executor/test_metrics.py holds them together).
"""

# ruff: noqa: S608 - the SQL is built from names and literals of this file, never from input
from __future__ import annotations

from django.db import migrations, models

# Seconds, as the exposition's `le` labels print them (f"{bound:g}").
BUCKETS = ("0.1", "0.5", "1", "5", "15", "60", "300", "900", "3600", "21600", "86400")
OPEN_PHASES = "('claimed', 'submitting')"


class Delta:
    """One addition to a counter row: for rows where `when` holds, add `value` to
    (name, label_a, label_b)."""

    def __init__(self, name, a="''", b="''", value="1", when="TRUE"):
        self.name, self.a, self.b, self.value, self.when = name, a, b, value, when


def _bucket(took):
    cases = " ".join(f"WHEN {took} <= {bound} THEN '{bound}'" for bound in BUCKETS)
    return f"CASE {cases} ELSE '+Inf' END"


def step_deltas(took, *, old=None, new=None):
    """What a step's move changes: its state's gauges, its run's counts, and the histogram
    when it reaches `completed` (once: completed only ever moves on to compensated)."""
    deltas, runs = [], []
    if old is not None:
        deltas += [
            Delta("steps", a=f"{old}.state", value="-1"),
            Delta(
                "compensation_steps",
                a=f"{old}.state",
                value="-1",
                when=f"{old}.compensates_id IS NOT NULL",
            ),
        ]
        runs.append((f"{old}.run_id", f"{old}.state", "-1"))
    if new is not None:
        deltas += [
            Delta("steps", a=f"{new}.state"),
            Delta("compensation_steps", a=f"{new}.state", when=f"{new}.compensates_id IS NOT NULL"),
            Delta("step_seconds_bucket", a=_bucket(took), when=f"{new}.state = 'completed'"),
            Delta("step_seconds_sum", value=took, when=f"{new}.state = 'completed'"),
        ]
        runs.append((f"{new}.run_id", f"{new}.state", "1"))
    return deltas, runs


def attempt_deltas(tool, *, old=None, new=None):
    """What an attempt's close changes: the open gauge, and the closed counter by outcome."""
    if new is None:  # deleted
        return [Delta("attempts_open", a=tool, value="-1", when=f"{old}.phase IN {OPEN_PHASES}")]
    outcome = (
        f"CASE WHEN {new}.phase = 'errored' THEN COALESCE(NULLIF({new}.error_class, ''), "
        f"'error') ELSE {new}.phase END"
    )
    closed = f"{new}.phase NOT IN {OPEN_PHASES}"
    recovered = f"{new}.phase = 'abandoned' AND {new}.error_class = 'lease_expired'"
    deltas = [
        Delta("attempts", a=tool, b=outcome, when=closed),
        Delta("lease_recoveries", when=f"{closed} AND {recovered}"),
    ]
    if old is None:
        deltas.append(Delta("attempts_open", a=tool, when=f"{new}.phase IN {OPEN_PHASES}"))
    else:
        deltas.append(Delta("attempts_open", a=tool, value="-1", when=closed))
    return deltas


# --- PostgreSQL: statement triggers over transition tables ------------------------------

UPSERT_COUNTER = (
    "INSERT INTO executor_counter AS c (name, label_a, label_b, shard, value) "
    "SELECT name, a, b, pg_backend_pid(), sum(d) FROM deltas GROUP BY name, a, b "
    "HAVING sum(d) <> 0 ORDER BY name, a, b "
    "ON CONFLICT (name, label_a, label_b, shard) DO UPDATE SET value = c.value + EXCLUDED.value"
)
UPSERT_RUNS = (
    "INSERT INTO executor_runstepcount AS c (run_id, state, shard, count) "
    "SELECT run_id, state, pg_backend_pid(), sum(d) FROM run_deltas GROUP BY run_id, state "
    "HAVING sum(d) <> 0 ORDER BY run_id, state "
    "ON CONFLICT (run_id, state, shard) DO UPDATE SET count = c.count + EXCLUDED.count"
)


def _pg_union(deltas, source):
    return " UNION ALL ".join(
        f"SELECT '{d.name}'::text AS name, ({d.a})::text AS a, ({d.b})::text AS b, "
        f"({d.value})::float8 AS d FROM {source} WHERE {d.when}"
        for d in deltas
    )


def _pg_function(name, body):
    """A statement trigger's function. Each statement runs through EXECUTE, planned at each
    call: PL/pgSQL would keep the plan of its first call, made for the transition tables of
    that call's size (a row or two: a nested loop joining old and new rows), and a later
    UPDATE of 50,000 steps then compared every old row with every new one (minutes)."""
    statements = [statement.strip() for statement in body.split(";") if statement.strip()]
    executed = " ".join(f"EXECUTE $q${statement}$q$;" for statement in statements)
    return (
        f"CREATE OR REPLACE FUNCTION {name}() RETURNS trigger LANGUAGE plpgsql AS $$ "
        f"BEGIN {executed} RETURN NULL; END $$"
    )


PG_TOOK = "EXTRACT(EPOCH FROM (n.state_since - n.created_at))::float8"
PG_STEP_SOURCES = {
    # (trigger event, transition tables, source, old alias, new alias)
    "inserted": ("INSERT", "NEW TABLE AS new_rows", "new_rows n", None, "n"),
    "moved": (
        "UPDATE",
        "OLD TABLE AS old_rows NEW TABLE AS new_rows",
        "old_rows o JOIN new_rows n ON n.id = o.id AND n.state <> o.state",
        "o",
        "n",
    ),
    "deleted": ("DELETE", "OLD TABLE AS old_rows", "old_rows o", "o", None),
}
PG_ATTEMPT_SOURCES = {
    "inserted": (
        "INSERT",
        "NEW TABLE AS new_rows",
        "new_rows n JOIN executor_step s ON s.id = n.step_id",
        None,
        "n",
    ),
    "moved": (
        "UPDATE",
        "OLD TABLE AS old_rows NEW TABLE AS new_rows",
        "old_rows o JOIN new_rows n ON n.id = o.id AND o.phase IN ('claimed', 'submitting') "
        "JOIN executor_step s ON s.id = n.step_id",
        "o",
        "n",
    ),
    "deleted": (
        "DELETE",
        "OLD TABLE AS old_rows",
        "old_rows o JOIN executor_step s ON s.id = o.step_id",
        "o",
        None,
    ),
}


def postgresql_statements():
    statements = []
    for kind, (event, tables, source, old, new) in PG_STEP_SOURCES.items():
        deltas, runs = step_deltas(PG_TOOK, old=old, new=new)
        run_union = " UNION ALL ".join(
            f"SELECT {run}::uuid AS run_id, {state}::text AS state, {d}::bigint AS d FROM {source}"
            for run, state, d in runs
        )
        body = (
            f"WITH deltas AS ({_pg_union(deltas, source)}) {UPSERT_COUNTER}; "
            f"WITH run_deltas AS ({run_union}) {UPSERT_RUNS};"
        )
        function = f"stepward_steps_{kind}"
        statements += [
            _pg_function(function, body),
            f"CREATE TRIGGER {function} AFTER {event} ON executor_step REFERENCING {tables} "
            f"FOR EACH STATEMENT EXECUTE FUNCTION {function}()",
        ]
    for kind, (event, tables, source, old, new) in PG_ATTEMPT_SOURCES.items():
        deltas = attempt_deltas("s.tool", old=old, new=new)
        function = f"stepward_attempts_{kind}"
        statements += [
            _pg_function(
                function, f"WITH deltas AS ({_pg_union(deltas, source)}) {UPSERT_COUNTER};"
            ),
            f"CREATE TRIGGER {function} AFTER {event} ON executor_attempt REFERENCING {tables} "
            f"FOR EACH STATEMENT EXECUTE FUNCTION {function}()",
        ]
    return statements


def postgresql_reverse():
    statements = []
    for table, prefix in (("executor_step", "steps"), ("executor_attempt", "attempts")):
        for kind in ("inserted", "moved", "deleted"):
            statements += [
                f"DROP TRIGGER IF EXISTS stepward_{prefix}_{kind} ON {table}",
                f"DROP FUNCTION IF EXISTS stepward_{prefix}_{kind}()",
            ]
    return statements


# --- SQLite: row triggers (one writer at a time: shard 0) -------------------------------

SQLITE_TOOK = "((julianday(NEW.state_since) - julianday(NEW.created_at)) * 86400.0)"


def _sqlite_upserts(deltas, runs):
    statements = [
        f"INSERT INTO executor_counter (name, label_a, label_b, shard, value) "
        f"SELECT '{d.name}', {d.a}, {d.b}, 0, {d.value} WHERE {d.when} "
        "ON CONFLICT (name, label_a, label_b, shard) DO UPDATE SET value = value + excluded.value;"
        for d in deltas
    ]
    statements += [
        f"INSERT INTO executor_runstepcount (run_id, state, shard, count) "
        f"SELECT {run}, {state}, 0, {d} WHERE TRUE "
        "ON CONFLICT (run_id, state, shard) DO UPDATE SET count = count + excluded.count;"
        for run, state, d in runs
    ]
    return " ".join(statements)


def sqlite_statements():
    tool_of = "(SELECT tool FROM executor_step WHERE id = {}.step_id)"
    triggers = {
        "stepward_steps_inserted": (
            "AFTER INSERT ON executor_step",
            _sqlite_upserts(*step_deltas(SQLITE_TOOK, new="NEW")),
        ),
        "stepward_steps_moved": (
            "AFTER UPDATE OF state ON executor_step WHEN OLD.state <> NEW.state",
            _sqlite_upserts(*step_deltas(SQLITE_TOOK, old="OLD", new="NEW")),
        ),
        "stepward_steps_deleted": (
            "AFTER DELETE ON executor_step",
            _sqlite_upserts(*step_deltas(SQLITE_TOOK, old="OLD")),
        ),
        "stepward_attempts_inserted": (
            "AFTER INSERT ON executor_attempt",
            _sqlite_upserts(attempt_deltas(tool_of.format("NEW"), new="NEW"), []),
        ),
        "stepward_attempts_moved": (
            "AFTER UPDATE OF phase ON executor_attempt "
            f"WHEN OLD.phase IN {OPEN_PHASES} AND NEW.phase NOT IN {OPEN_PHASES}",
            _sqlite_upserts(attempt_deltas(tool_of.format("NEW"), old="OLD", new="NEW"), []),
        ),
        "stepward_attempts_deleted": (
            "AFTER DELETE ON executor_attempt",
            _sqlite_upserts(attempt_deltas(tool_of.format("OLD"), old="OLD"), []),
        ),
    }
    return [
        f"CREATE TRIGGER {name} {when} BEGIN {body} END" for name, (when, body) in triggers.items()
    ]


def sqlite_reverse():
    return [
        f"DROP TRIGGER IF EXISTS stepward_{prefix}_{kind}"
        for prefix in ("steps", "attempts")
        for kind in ("inserted", "moved", "deleted")
    ]


# --- the counts of what the ledger holds already ------------------------------------------

# Written for both PostgreSQL and SQLite.
BACKFILL = [
    "INSERT INTO executor_counter (name, label_a, label_b, shard, value) "
    "SELECT 'steps', state, '', 0, count(*) FROM executor_step GROUP BY state",
    "INSERT INTO executor_counter (name, label_a, label_b, shard, value) "
    "SELECT 'compensation_steps', state, '', 0, count(*) FROM executor_step "
    "WHERE compensates_id IS NOT NULL GROUP BY state",
    "INSERT INTO executor_runstepcount (run_id, state, shard, count) "
    "SELECT run_id, state, 0, count(*) FROM executor_step GROUP BY run_id, state",
    "INSERT INTO executor_counter (name, label_a, label_b, shard, value) "
    "SELECT 'attempts_open', s.tool, '', 0, count(*) FROM executor_attempt a "
    "JOIN executor_step s ON s.id = a.step_id WHERE a.phase IN ('claimed', 'submitting') "
    "GROUP BY s.tool",
    "INSERT INTO executor_counter (name, label_a, label_b, shard, value) "
    "SELECT 'attempts', s.tool, CASE WHEN a.phase = 'errored' THEN "
    "COALESCE(NULLIF(a.error_class, ''), 'error') ELSE a.phase END AS outcome, 0, count(*) "
    "FROM executor_attempt a JOIN executor_step s ON s.id = a.step_id "
    "WHERE a.phase NOT IN ('claimed', 'submitting') GROUP BY s.tool, outcome",
    "INSERT INTO executor_counter (name, label_a, label_b, shard, value) "
    "SELECT 'lease_recoveries', '', '', 0, count(*) FROM executor_attempt "
    "WHERE phase = 'abandoned' AND error_class = 'lease_expired'",
]
# Each step that ever completed, at the time of its move to completed.
BACKFILL_TOOK = {
    "postgresql": "EXTRACT(EPOCH FROM (e.created_at - s.created_at))::float8",
    "sqlite": "((julianday(e.created_at) - julianday(s.created_at)) * 86400.0)",
}


def backfill_statements(vendor):
    statements = list(BACKFILL)
    took = BACKFILL_TOOK[vendor]
    completed = (
        "FROM executor_event e JOIN executor_step s ON s.id = e.step_id "
        "WHERE e.to_state = 'completed'"
    )
    statements += [
        "INSERT INTO executor_counter (name, label_a, label_b, shard, value) "
        f"SELECT 'step_seconds_bucket', bucket, '', 0, count(*) FROM "
        f"(SELECT {_bucket(took)} AS bucket {completed}) t GROUP BY bucket",
        "INSERT INTO executor_counter (name, label_a, label_b, shard, value) "
        f"SELECT 'step_seconds_sum', '', '', 0, COALESCE(sum({took}), 0) {completed}",
    ]
    return statements


def create_triggers(apps, schema_editor):
    vendor = schema_editor.connection.vendor
    if vendor not in ("postgresql", "sqlite"):
        raise NotImplementedError(f"counters need PostgreSQL or SQLite, not {vendor}")
    for statement in backfill_statements(vendor):
        schema_editor.execute(statement)
    create = postgresql_statements() if vendor == "postgresql" else sqlite_statements()
    for statement in create:
        schema_editor.execute(statement)


def drop_triggers(apps, schema_editor):
    vendor = schema_editor.connection.vendor
    drop = postgresql_reverse() if vendor == "postgresql" else sqlite_reverse()
    for statement in drop:
        schema_editor.execute(statement)


class Migration(migrations.Migration):
    dependencies = [
        ("executor", "0017_reviewers_inbox"),
    ]

    operations = [
        migrations.CreateModel(
            name="Counter",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("name", models.CharField(max_length=40)),
                ("label_a", models.CharField(blank=True, max_length=200)),
                ("label_b", models.CharField(blank=True, max_length=200)),
                ("shard", models.IntegerField(default=0)),
                ("value", models.FloatField(default=0)),
            ],
            options={
                "constraints": [
                    models.UniqueConstraint(
                        fields=("name", "label_a", "label_b", "shard"), name="counter_unique"
                    )
                ],
            },
        ),
        migrations.CreateModel(
            name="RunStepCount",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("run_id", models.UUIDField()),
                ("state", models.CharField(max_length=20)),
                ("shard", models.IntegerField(default=0)),
                ("count", models.BigIntegerField(default=0)),
            ],
            options={
                "constraints": [
                    models.UniqueConstraint(
                        fields=("run_id", "state", "shard"), name="runstepcount_unique"
                    )
                ],
            },
        ),
        migrations.RunPython(create_triggers, drop_triggers, elidable=False),
    ]
