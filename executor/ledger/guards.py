"""Invariants the database keeps by trigger rather than by index (DESIGN.md §3).

Two rules of a step's attempts were unique indexes:

- **one open attempt a step** (`attempt_one_open_per_step`), a partial unique index on an
  attempt's step where its phase is open. PostgreSQL cannot update a row in place (HOT) when
  a column an index reads changes, a predicate's included: every move of an attempt's phase
  wrote a new entry into each of the attempts' indexes;
- **one attempt a fence** (`attempt_unique_fence`), a unique index on (step, fence): about
  100 bytes a step at a million steps (issue 25), for a look at a step's one to three
  attempts that (step, number), kept, already serves.

One trigger keeps both without an index: an attempt inserted, or updated onto another step,
another fence or from closed to open, is refused when its step already has an attempt with
its fence, or (if it is open) an open one. On PostgreSQL it first locks the step's row (FOR NO
KEY UPDATE), so two transactions writing attempts of one step cannot both pass the look (a
claim holds that row already: it has just moved the step and counted its fence); SQLite runs
one writer at a time. A refusal is an IntegrityError naming the rule, on both databases.

`install` is idempotent: migration 0026 runs it, and so does every `migrate` after it
(executor/signals.py), because SQLite drops a table's triggers when a later migration
rebuilds the table.
"""

from __future__ import annotations

from executor.common.triggers import TriggerSet

# The migration that installed them: until it is applied the unique indexes keep the rules,
# and `migrate` does not put the triggers back.
MIGRATION = "0026_attempt_rules_by_trigger"
OPEN = "('claimed', 'submitting')"
ONE_OPEN = "attempt_one_open_per_step"
ONE_FENCE = "attempt_unique_fence"
MESSAGE = {
    ONE_OPEN: f"{ONE_OPEN}: the step already has an open attempt",
    ONE_FENCE: f"{ONE_FENCE}: the step already has an attempt with this fence",
}
# An update the rules look at: the others (submitting, a close) do not call the trigger.
_MOVED = (
    "NEW.step_id <> OLD.step_id OR NEW.fence <> OLD.fence"
    f" OR (NEW.phase IN {OPEN} AND OLD.phase NOT IN {OPEN})"
)

POSTGRESQL = [
    f"""CREATE OR REPLACE FUNCTION stepward_attempt_rules() RETURNS trigger
    LANGUAGE plpgsql AS $$
    DECLARE
        same_fence boolean;
        another_open boolean;
    BEGIN
        PERFORM 1 FROM executor_step WHERE id = NEW.step_id FOR NO KEY UPDATE;
        SELECT coalesce(bool_or(fence = NEW.fence), false),
               coalesce(bool_or(phase IN {OPEN}), false)
          INTO same_fence, another_open
          FROM executor_attempt WHERE step_id = NEW.step_id AND id <> NEW.id;
        IF same_fence THEN
            RAISE EXCEPTION '{MESSAGE[ONE_FENCE]}' USING ERRCODE = 'unique_violation',
                DETAIL = format('step %s, fence %s', NEW.step_id, NEW.fence);
        END IF;
        IF another_open AND NEW.phase IN {OPEN} THEN
            RAISE EXCEPTION '{MESSAGE[ONE_OPEN]}' USING ERRCODE = 'unique_violation',
                DETAIL = format('step %s', NEW.step_id);
        END IF;
        RETURN NEW;
    END $$""",  # noqa: S608 - constants
    """CREATE OR REPLACE TRIGGER attempt_rules BEFORE INSERT ON executor_attempt
    FOR EACH ROW EXECUTE FUNCTION stepward_attempt_rules()""",
    f"""CREATE OR REPLACE TRIGGER attempt_rules_moved BEFORE UPDATE OF step_id, fence, phase
    ON executor_attempt FOR EACH ROW WHEN ({_MOVED})
    EXECUTE FUNCTION stepward_attempt_rules()""",
]
POSTGRESQL_REVERSE = [
    "DROP TRIGGER IF EXISTS attempt_rules ON executor_attempt",
    "DROP TRIGGER IF EXISTS attempt_rules_moved ON executor_attempt",
    "DROP FUNCTION IF EXISTS stepward_attempt_rules()",
]


def _sqlite_exists(where: str, *, other: bool) -> str:
    # (On insert the new row is not in the table yet: SQLite gives a BEFORE INSERT trigger
    # no id to leave out.)
    return (
        "EXISTS (SELECT 1 FROM executor_attempt"  # noqa: S608 - constants
        f" WHERE step_id = NEW.step_id AND {where}{' AND id <> NEW.id' if other else ''})"
    )


def _sqlite(name: str, event: str, when: str, rule: str) -> str:
    return (
        f"CREATE TRIGGER IF NOT EXISTS {name} BEFORE {event} ON executor_attempt"
        f" FOR EACH ROW WHEN {when} BEGIN SELECT RAISE(ABORT, '{MESSAGE[rule]}'); END"
    )


SQLITE = [
    _sqlite(
        "attempt_rules_fence",
        "INSERT",
        _sqlite_exists("fence = NEW.fence", other=False),
        ONE_FENCE,
    ),
    _sqlite(
        "attempt_rules_open",
        "INSERT",
        f"NEW.phase IN {OPEN} AND {_sqlite_exists(f'phase IN {OPEN}', other=False)}",
        ONE_OPEN,
    ),
    _sqlite(
        "attempt_rules_fence_moved",
        "UPDATE OF step_id, fence",
        _sqlite_exists("fence = NEW.fence", other=True),
        ONE_FENCE,
    ),
    _sqlite(
        "attempt_rules_open_moved",
        "UPDATE OF step_id, phase",
        f"NEW.phase IN {OPEN} AND (OLD.phase NOT IN {OPEN} OR OLD.step_id <> NEW.step_id)"
        f" AND {_sqlite_exists(f'phase IN {OPEN}', other=True)}",
        ONE_OPEN,
    ),
]
NAMES = {
    "postgresql": ("attempt_rules", "attempt_rules_moved"),
    "sqlite": (
        "attempt_rules_fence",
        "attempt_rules_open",
        "attempt_rules_fence_moved",
        "attempt_rules_open_moved",
    ),
}
TRIGGERS = TriggerSet(
    "the ledger's guards",
    create={"postgresql": POSTGRESQL, "sqlite": SQLITE},
    drop={
        "postgresql": POSTGRESQL_REVERSE,
        "sqlite": [f"DROP TRIGGER IF EXISTS {name}" for name in NAMES["sqlite"]],
    },
    names=NAMES,
)
install = TRIGGERS.install
uninstall = TRIGGERS.uninstall
installed = TRIGGERS.installed
