"""The rule one open attempt a step, kept by a trigger (executor/ledger/guards.py), holds
between two transactions as the partial unique index it replaced did: the second waits for
the first's step and is refused once the first commits. And the trigger is there after every
`migrate`, on both databases."""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg
import pytest
from django.core.management import call_command
from django.db import connection

from executor.ledger import guards
from executor.ledger.records import Run
from executor.ledger.states import State
from tests.support.factories import WORKER, step_in

INSERT_OPEN = (
    "INSERT INTO executor_attempt (step_id, number, fence, worker, phase, error_class,"
    " error_message, cost, fenced_out_write, claimed_at)"
    " VALUES (%s, %s, %s, %s, 'claimed', '', '', 0, '', now())"
)


def dsn() -> str:
    db = connection.settings_dict
    return (
        f"host={db.get('HOST') or '127.0.0.1'} port={db.get('PORT') or 5432}"
        f" dbname={db['NAME']} user={db.get('USER') or 'postgres'}"
        f" password={db.get('PASSWORD') or ''}"
    )


def waiting_on_a_lock(pid: int) -> bool:
    with psycopg.connect(dsn(), autocommit=True) as look:
        row = look.execute(
            "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", [pid]
        ).fetchone()
    return row is not None and row[0] == "Lock"


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_two_transactions_cannot_both_open_an_attempt_on_one_step(run: Run) -> None:
    step = step_in(run, State.RUNNING)
    outcome: dict[str, Any] = {}
    with psycopg.connect(dsn()) as first, psycopg.connect(dsn()) as second:
        # The first claims the step, the way the engine does: its row, then the attempt.
        first.execute("UPDATE executor_step SET fence = fence + 1 WHERE id = %s", [step.pk])
        first.execute(INSERT_OPEN, [step.pk, 1, 1, WORKER])
        second_pid = second.info.backend_pid

        def open_second() -> None:
            try:
                second.execute(INSERT_OPEN, [step.pk, 2, 2, "another"])
                second.commit()
                outcome["second"] = "committed"
            except psycopg.errors.UniqueViolation as error:
                second.rollback()
                outcome["second"] = str(error)

        racer = threading.Thread(target=open_second)
        racer.start()
        deadline = time.monotonic() + 30
        while not waiting_on_a_lock(second_pid):
            assert racer.is_alive(), f"the second did not wait: {outcome}"
            assert time.monotonic() < deadline, "the second never waited for the step"
            time.sleep(0.05)
        first.commit()
        racer.join(30)

    assert not racer.is_alive()
    assert outcome["second"].startswith(guards.MESSAGE[guards.ONE_OPEN]), outcome
    with connection.cursor() as cursor:
        cursor.execute("SELECT worker FROM executor_attempt WHERE step_id = %s", [step.pk])
        assert [row[0] for row in cursor.fetchall()] == [WORKER]


@pytest.mark.django_db(transaction=True)
def test_migrate_puts_the_guard_back() -> None:
    # SQLite drops a table's triggers when a migration rebuilds it; `migrate` puts them back.
    guards.uninstall(connection)
    assert guards.installed(connection) == set()

    call_command("migrate", "executor", verbosity=0)

    assert guards.installed(connection) == set(guards.NAMES[connection.vendor])


COUNTER_TRIGGERS = {"stepward_attempts_inserted", "stepward_attempts_moved"}


def attempt_triggers() -> set[str]:
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(
                "SELECT tgname FROM pg_trigger WHERE NOT tgisinternal"
                " AND tgrelid = 'executor_attempt'::regclass"
            )
        else:
            cursor.execute(
                "SELECT name FROM sqlite_master WHERE type = 'trigger'"
                " AND tbl_name = 'executor_attempt'"
            )
        return {row[0] for row in cursor.fetchall()}


@pytest.mark.django_db(transaction=True)
def test_0026_both_ways_keeps_the_attempts_counters() -> None:
    # On SQLite, 0026 rebuilds the attempts' table (the unique (step, fence) goes, and comes
    # back on the way back), which drops its triggers: the counters' must come back too.
    assert attempt_triggers() >= COUNTER_TRIGGERS
    try:
        call_command("migrate", "executor", "0025", verbosity=0)
        assert attempt_triggers() >= COUNTER_TRIGGERS
        assert guards.installed(connection) == set()
    finally:
        call_command("migrate", "executor", verbosity=0)
    assert attempt_triggers() >= COUNTER_TRIGGERS
    assert guards.installed(connection) == set(guards.NAMES[connection.vendor])
