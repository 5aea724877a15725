"""Real processes for recovery tests: web, worker and sweeper over the desk, and stalls
held at a commit point."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from django.conf import settings as django_settings
from django.db import connection

from console.celery import app as celery_app
from executor.drill import invariants
from executor.drill.processes import Child
from executor.ledger.records import Step
from tests.support.postgres import end_backends
from tests.support.processes import (
    Desk,
    Sweeper,
    Worker,
    describe_ledger,
    wait_until,
)

# Generous: a deadline only decides when a stuck test gives up, never whether it passes.
DEADLINE_SECONDS = 60.0


# Short timings so that recovery happens within a test (STACK-NOTES, DESIGN.md §7).
FAST_EXECUTOR = {
    "EXECUTOR_LEASE_SECONDS": "2",
    "EXECUTOR_SWEEP_SECONDS": "0.5",
    "EXECUTOR_REDISPATCH_AFTER": "1",
}


# Holds one worker inside a chosen commit long enough to kill it there (PostgreSQL), and for
# Stall.kill to find the sleeping backend afterwards on a loaded machine.
STALL_SECONDS = 10


STALL_MARKER = "stepward-test-stall"


# What Celery logs when its consumer dies (e.g. kombu's filesystem transport reading a
# message file its publisher has created but not written yet).
UNRECOVERABLE = "Unrecoverable error"


def use_queue(queue: str) -> None:
    """Makes this process publish to `queue`, before or after its app first published."""
    django_settings.CELERY_TASK_DEFAULT_QUEUE = queue
    celery_app.conf.task_default_queue = queue
    for cached in ("queues", "default_queue", "router"):
        celery_app.amqp.__dict__.pop(cached, None)


@contextmanager
def own_queue(purpose: str) -> Iterator[str]:
    """Publishes to a queue of this test process alone while the block runs; empties it
    before and after, and then publishes where it did before."""
    configured = django_settings.CELERY_TASK_DEFAULT_QUEUE
    own = f"{configured}-{purpose}-{os.getpid()}"
    use_queue(own)
    celery_app.control.purge()
    try:
        yield own
    finally:
        celery_app.control.purge()
        use_queue(configured)


def broker_env() -> dict[str, str]:
    """The broker settings of this process, as the environment that reproduces them."""
    queue = django_settings.CELERY_TASK_DEFAULT_QUEUE
    # The app reads the settings lazily: check that what it publishes with is what the
    # workers will be told to consume from.
    assert celery_app.conf.broker_url == django_settings.CELERY_BROKER_URL
    assert celery_app.conf.task_default_queue == queue
    assert celery_app.amqp.router.route({}, "stepward.execute_step")["queue"].name == queue
    assert celery_app.conf.broker_transport_options == (
        django_settings.CELERY_BROKER_TRANSPORT_OPTIONS
    )
    env = {"CELERY_QUEUE": queue, "STEPWARD_BROKER_DIR": str(django_settings.BROKER_DIR)}
    # The variable as this process got it, not the URL settings derived from it: unset
    # means the embedded broker, which settings configure from the variable's absence.
    if os.environ.get("CELERY_BROKER_URL"):
        env["CELERY_BROKER_URL"] = os.environ["CELERY_BROKER_URL"]
    return env


@dataclass
class Cluster:
    """The processes of one test, and what a person needs to read when it fails."""

    desk: Desk
    env: dict[str, str]
    tmp: Path
    processes: list[Child] = field(default_factory=list)

    @property
    def queue(self) -> str:
        return self.env["CELERY_QUEUE"]

    @property
    def mail_dir(self) -> Path:
        return Path(self.env["EMAIL_FILE_PATH"])

    def worker(self, name: str = "w1") -> Worker:
        worker = Worker(name, self.env, self.tmp / f"{name}.log", self.queue)
        self.processes.append(worker)
        return worker

    def sweeper(self) -> Sweeper:
        sweeper = Sweeper(self.env, self.tmp / "sweeper.log")
        self.processes.append(sweeper)
        return sweeper

    def diagnose(self) -> str:
        parts = [process.describe() for process in self.processes]
        try:
            parts.append(f"--- desk stats ---\n{self.desk.stats()}")
        except Exception as error:  # noqa: BLE001 - a diagnosis must not hide the failure
            parts.append(f"--- desk stats unavailable: {error!r}")
        parts.append(describe_ledger())
        return "\n".join(parts)

    def wait_for[T](
        self, probe: Callable[[], T], *, what: str, seconds: float = DEADLINE_SECONDS
    ) -> T:
        def checked() -> T:
            # A worker the test did not end would otherwise only show as a timeout.
            for process in self.processes:
                if isinstance(process, Worker) and UNRECOVERABLE in process.log():
                    pytest.fail(f"{process.name} died on its own\n{self.diagnose()}")
            return probe()

        return wait_until(checked, seconds=seconds, what=what, diagnose=self.diagnose)

    def wait_state(self, step: Step, *states: str, seconds: float = DEADLINE_SECONDS) -> Step:
        def reached() -> Step | None:
            fresh = Step.objects.get(pk=step.pk)
            return fresh if fresh.state in states else None

        return self.wait_for(reached, what=f"step {step.key} to be {states}", seconds=seconds)

    def wait_task_outcome(self, worker: Worker, outcome: str) -> None:
        """Waits for `worker` to log a task that returned `outcome`.

        Celery logs a task's return after the task committed its work, so a test that saw the
        step settle may read the log a moment before that line is written.
        """
        self.wait_for(
            lambda: outcome in worker.task_outcomes().values(),
            what=f"{worker.name} to log a task that returned {outcome!r}",
        )

    def wait_settled(self, step: Step, *, seconds: float = DEADLINE_SECONDS) -> Step:
        def settled() -> Step | None:
            fresh = Step.objects.get(pk=step.pk)
            return fresh if is_settled(fresh) else None

        return self.wait_for(settled, what=f"step {step.key} to settle", seconds=seconds)

    def stop_all(self) -> None:
        # SIGKILL: nothing a test started has anything left to finish.
        for process in self.processes:
            process.kill()


def is_settled(step: Step) -> bool:
    """Final, or `unknown` with no lookup due: waiting visibly for a person."""
    return invariants.is_settled(step.state, step.not_before)


class Stall:
    """Makes one worker's commit of one step hang (PostgreSQL) or fail (SQLite).

    On PostgreSQL a trigger sleeps inside the worker's statement, so the test can SIGKILL
    the worker there for real (`kill`: the server rolls the write back). SQLite has
    no sleep, so its trigger aborts the transaction instead and the test kills the worker
    afterwards: the ledger is left exactly as a kill at that commit would leave it.
    """

    def __init__(self) -> None:
        self.triggers: list[tuple[str, str]] = []

    @property
    def postgres(self) -> bool:
        return connection.vendor == "postgresql"

    def _step_literal(self, step: Step) -> str:
        # UUIDs are native on PostgreSQL and 32 hex characters on SQLite.
        return f"'{step.pk}'::uuid" if self.postgres else f"'{step.pk.hex}'"

    def _install(self, table: str, timing: str, condition: str) -> None:
        name = f"stepward_test_stall_{len(self.triggers)}"
        with connection.cursor() as cursor:
            if self.postgres:
                cursor.execute(
                    "CREATE OR REPLACE FUNCTION stepward_test_stall() RETURNS trigger "
                    "LANGUAGE plpgsql AS $$ BEGIN "
                    f"PERFORM pg_sleep({STALL_SECONDS}); RETURN NEW; END $$"
                )
                cursor.execute(
                    f"CREATE TRIGGER {name} {timing} ON {table} FOR EACH ROW "
                    f"WHEN ({condition}) EXECUTE FUNCTION stepward_test_stall()"
                )
            else:
                cursor.execute(
                    f"CREATE TRIGGER {name} {timing} ON {table} WHEN {condition} "
                    f"BEGIN SELECT RAISE(ABORT, '{STALL_MARKER}'); END"
                )
        self.triggers.append((name, table))

    def at_submitting(self, step: Step) -> None:
        """Stalls the commit that marks the first attempt `submitting` (DESIGN.md §5.4)."""
        self._install(
            "executor_attempt",
            "BEFORE UPDATE",
            f"NEW.step_id = {self._step_literal(step)} AND NEW.number = 1 "
            "AND OLD.phase = 'claimed' AND NEW.phase = 'submitting'",
        )

    def at_completion(self, step: Step) -> None:
        """Stalls a worker's verifying → completed commit (§5.7), not the sweeper's."""
        self._install(
            "executor_event",
            "BEFORE INSERT",
            f"NEW.step_id = {self._step_literal(step)} AND NEW.actor LIKE 'executor:%' "
            "AND NEW.from_state = 'verifying' AND NEW.to_state = 'completed'",
        )

    def at_lookup_found(self) -> None:
        """Stalls every lookup's unknown → verifying commit (any step: for a step posted
        through another process, whose id the test learns only afterwards)."""
        self._install(
            "executor_event",
            "BEFORE INSERT",
            "NEW.from_state = 'unknown' AND NEW.to_state = 'verifying'",
        )

    def holds(self, worker: Worker) -> bool:
        """Whether `worker` is inside the stalled commit (or, on SQLite, had it fail)."""
        if not self.postgres:
            return STALL_MARKER in worker.current_log()
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND wait_event = 'PgSleep' AND pid <> pg_backend_pid()"
            )
            row = cursor.fetchone()
        return bool(row and row[0])

    def kill(self, worker: Worker) -> None:
        """SIGKILLs `worker` inside the stalled commit; on PostgreSQL also ends the server
        process sleeping for it, so that commit never happens.

        PostgreSQL notices a dead client only when it next reads from or writes to it
        (`client_connection_check_interval` is off by default): the sleeping statement would
        run on and, where it is written outside a transaction (the `submitting` mark,
        DESIGN.md §5.4), commit seconds after the kill. A worker killed before its commit
        reached the server leaves no such write; ending the backend rolls it back.
        """
        worker.kill()
        if self.postgres:
            # A trigger firing for each row is between two sleeps for a moment: try again.
            wait_until(self._end_sleeping_backend, seconds=10, what="the stalled backend to end")

    def _end_sleeping_backend(self) -> bool:
        ended = end_backends("wait_event = 'PgSleep'")
        return bool(ended) and all(ended)

    def remove(self) -> None:
        with connection.cursor() as cursor:
            for name, table in self.triggers:
                if self.postgres:
                    cursor.execute(f"DROP TRIGGER IF EXISTS {name} ON {table}")
                else:
                    cursor.execute(f"DROP TRIGGER IF EXISTS {name}")
            if self.postgres and self.triggers:
                cursor.execute("DROP FUNCTION IF EXISTS stepward_test_stall()")
        self.triggers.clear()
