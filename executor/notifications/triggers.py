"""The database's own part of notifications (docs/notifications.md): triggers that insert a
`Notification` in the statement that moves a step into a waiting state or pauses a run.

So the record commits or rolls back with the move, on every path that moves steps (one
move, a batch's UPDATE, a post's single statement of CTEs), and the engine sends nothing
more for it. The WHEN clauses keep the ordinary moves (pending → running → completed) from
calling anything; on PostgreSQL a post's steps are looked at once per statement.

`install` is idempotent: migration 0014 runs it, and so does every `migrate` after it,
because SQLite drops a table's triggers when a later migration rebuilds the table.
"""

from __future__ import annotations

from executor.common.triggers import TriggerSet

WAITING = "('planned', 'unknown', 'dead', 'blocked')"
KIND = (
    "CASE NEW.state"
    " WHEN 'planned' THEN CASE WHEN NEW.compensates_id IS NULL"
    " THEN 'approval' ELSE 'compensation' END"
    " WHEN 'failed' THEN 'failed_compensation'"
    " ELSE NEW.state END"
)
STEP_INSERTED = f"NEW.state IN {WAITING}"
STEP_MOVED = (
    f"NEW.state <> OLD.state AND (NEW.state IN {WAITING}"
    " OR (NEW.state = 'failed' AND NEW.compensates_id IS NOT NULL))"
)
RUN_PAUSED = "NEW.status = 'paused' AND OLD.status <> 'paused'"
INSERT_STEP = (
    "INSERT INTO executor_notification (kind, run_id, step_id, created_at)"  # noqa: S608 - constants
    f" VALUES ({KIND}, NEW.run_id, NEW.id, NEW.state_since)"
)
INSERT_INSERTED = (
    "INSERT INTO executor_notification (kind, run_id, step_id, created_at)"  # noqa: S608 - constants
    f" SELECT {KIND.replace('NEW.', '')}, run_id, id, state_since FROM inserted"
    f" WHERE {STEP_INSERTED.replace('NEW.', '')}"
)
INSERT_RUN = (
    "INSERT INTO executor_notification (kind, run_id, step_id, created_at)"
    " VALUES ('paused', NEW.id, NULL, {now})"
)
NAMES = ("stepward_step_inserted_waits", "stepward_step_moved_waits", "stepward_run_paused")

POSTGRESQL = [
    f"""CREATE OR REPLACE FUNCTION stepward_step_waits() RETURNS trigger LANGUAGE plpgsql
    AS $$ BEGIN {INSERT_STEP}; RETURN NULL; END $$""",
    f"""CREATE OR REPLACE FUNCTION stepward_run_paused() RETURNS trigger LANGUAGE plpgsql
    AS $$ BEGIN {INSERT_RUN.format(now="now()")}; RETURN NULL; END $$""",
    # Per statement, over the rows it inserted: a post of 500 steps that wait for approval
    # makes one INSERT … SELECT, not 500 calls of a function.
    f"""CREATE OR REPLACE FUNCTION stepward_notify_steps_inserted() RETURNS trigger LANGUAGE plpgsql
    AS $$ BEGIN {INSERT_INSERTED}; RETURN NULL; END $$""",
    """CREATE OR REPLACE TRIGGER stepward_step_inserted_waits AFTER INSERT ON executor_step
    REFERENCING NEW TABLE AS inserted FOR EACH STATEMENT
    EXECUTE FUNCTION stepward_notify_steps_inserted()""",
    f"""CREATE OR REPLACE TRIGGER stepward_step_moved_waits AFTER UPDATE OF state
    ON executor_step FOR EACH ROW WHEN ({STEP_MOVED}) EXECUTE FUNCTION stepward_step_waits()""",
    f"""CREATE OR REPLACE TRIGGER stepward_run_paused AFTER UPDATE OF status ON executor_run
    FOR EACH ROW WHEN ({RUN_PAUSED}) EXECUTE FUNCTION stepward_run_paused()""",
]
POSTGRESQL_REVERSE = [
    "DROP TRIGGER IF EXISTS stepward_step_inserted_waits ON executor_step",
    "DROP TRIGGER IF EXISTS stepward_step_moved_waits ON executor_step",
    "DROP TRIGGER IF EXISTS stepward_run_paused ON executor_run",
    "DROP FUNCTION IF EXISTS stepward_step_waits()",
    "DROP FUNCTION IF EXISTS stepward_notify_steps_inserted()",
    "DROP FUNCTION IF EXISTS stepward_run_paused()",
]
SQLITE = [
    f"""CREATE TRIGGER IF NOT EXISTS stepward_step_inserted_waits AFTER INSERT ON executor_step
    FOR EACH ROW WHEN {STEP_INSERTED} BEGIN {INSERT_STEP}; END""",
    f"""CREATE TRIGGER IF NOT EXISTS stepward_step_moved_waits AFTER UPDATE OF state
    ON executor_step FOR EACH ROW WHEN {STEP_MOVED} BEGIN {INSERT_STEP}; END""",
    f"""CREATE TRIGGER IF NOT EXISTS stepward_run_paused AFTER UPDATE OF status ON executor_run
    FOR EACH ROW WHEN {RUN_PAUSED}
    BEGIN {INSERT_RUN.format(now="strftime('%Y-%m-%d %H:%M:%f', 'now')")}; END""",
]
SQLITE_REVERSE = [f"DROP TRIGGER IF EXISTS {name}" for name in NAMES]


TRIGGERS = TriggerSet(
    "notification triggers",
    create={"postgresql": POSTGRESQL, "sqlite": SQLITE},
    drop={"postgresql": POSTGRESQL_REVERSE, "sqlite": SQLITE_REVERSE},
    names={"postgresql": NAMES, "sqlite": NAMES},
)
install = TRIGGERS.install
uninstall = TRIGGERS.uninstall
installed = TRIGGERS.installed
