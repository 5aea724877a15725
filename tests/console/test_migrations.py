"""Data migrations, run on rows made by today's code: a step's "waiting since" (0006)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import call_command
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.utils import timezone

from executor.engine import recovery
from executor.ledger import chain
from executor.ledger.records import Agent, Event, Run, Step
from executor.ledger.states import State
from tests.support.console import age, completed, reload, unknown

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("tools", "back_to_latest"),
]


def migrate(target: str) -> None:
    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    executor.migrate([("executor", target)])


def migrate_to_latest() -> None:
    executor = MigrationExecutor(connection)
    executor.migrate(executor.loader.graph.leaf_nodes("executor"))


@pytest.fixture
def back_to_latest() -> Iterator[None]:
    yield
    migrate_to_latest()


def test_state_since_of_existing_steps_is_when_their_state_was_entered(
    agent: Agent, run: Run
) -> None:
    waiting = unknown(agent, run, key="waiting", tool="console.lookup")
    age(waiting, timedelta(hours=3))
    entered = timezone.now() - timedelta(hours=2)
    # The event that moved it into unknown is two hours old; a lookup since kept it there.
    Event.objects.filter(step=waiting, to_state=State.UNKNOWN).update(created_at=entered)
    assert recovery.reconcile(waiting.pk) == State.UNKNOWN
    looked_at = reload(waiting).updated_at

    migrate("0005_tool_policies")
    migrate("0006_step_state_since")
    after = Step.objects.get(pk=waiting.pk)
    assert after.state_since == entered
    assert after.updated_at == looked_at


def test_the_chains_digests_keep_their_values_through_0022_both_ways(
    agent: Agent, run: Run
) -> None:
    steps = [completed(agent, run, key="done"), unknown(agent, run, key="maybe")]
    events = list(Event.objects.filter(step__in=steps).values_list("pk", *DIGESTS))
    heads = list(Step.objects.filter(pk__in=[s.pk for s in steps]).values_list("pk", "head_hash"))
    assert len(events) > len(steps)
    assert all(len(e[2]) == 64 for e in events)

    migrate("0021_run_closed")  # back: the hex text they were
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT id, {', '.join(DIGESTS)} FROM executor_event")
        assert sorted(cursor.fetchall()) == sorted(events)
        cursor.execute("SELECT id, head_hash FROM executor_step")
        assert {(uuid.UUID(str(pk)), head) for pk, head in cursor.fetchall()} == set(heads)

    migrate("0022_digests_as_bytes")  # and forth: the same digests, 32 bytes on PostgreSQL
    assert list(Event.objects.filter(step__in=steps).values_list("pk", *DIGESTS)) == events
    assert set(
        Step.objects.filter(pk__in=[s.pk for s in steps]).values_list("pk", "head_hash")
    ) == set(heads)
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT max(octet_length(hash)), min(octet_length(hash)) FROM executor_event"
            )
            assert cursor.fetchone() == (32, 32)
    out = StringIO()
    call_command("verify_ledger", stdout=out)
    assert out.getvalue().startswith("2 steps, ")
    assert ", 0 broken" in out.getvalue()


DIGESTS = ("prev_hash", "hash", "step_digest")


def test_the_steps_input_hashes_keep_their_values_through_0023_both_ways(
    agent: Agent, run: Run
) -> None:
    steps = [completed(agent, run, key="done"), unknown(agent, run, key="maybe")]
    hashes = set(Step.objects.values_list("pk", "input_hash"))
    assert len(hashes) == 2
    assert all(len(h) == 64 for _, h in hashes)

    migrate("0022_digests_as_bytes")  # back: the hex text they were
    with connection.cursor() as cursor:
        cursor.execute("SELECT id, input_hash FROM executor_step")
        assert {(uuid.UUID(str(pk)), h) for pk, h in cursor.fetchall()} == hashes

    migrate_to_latest()  # and forth: the same hashes
    assert set(Step.objects.values_list("pk", "input_hash")) == hashes
    assert Step.objects.filter(pk=steps[0].pk, input_hash=steps[0].input_hash).exists()
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT min(octet_length(input_hash)) FROM executor_step")
            assert cursor.fetchone() == (32,)
            # An attempt's step is indexed only by the indexes that lead with it.
            cursor.execute(
                "SELECT indexname FROM pg_indexes WHERE tablename = 'executor_attempt' "
                "AND indexdef LIKE '%%(step_id%%'"
            )
            # (One open attempt a step and one a fence are a trigger since 0026.)
            assert sorted(row[0] for row in cursor.fetchall()) == [
                "attempt_unique_number",
            ]
    assert {step.pk.version for step in steps} == {7}
    out = StringIO()
    call_command("verify_ledger", stdout=out)
    assert ", 0 broken" in out.getvalue()


def test_0024_is_unapplied_only_while_no_checkpoint_lists_packed(agent: Agent, run: Run) -> None:
    """Checkpoints signed over packed listings cannot be turned back into JSON ones: the way
    back refuses rather than drop them (the chain would no longer verify)."""
    completed(agent, run, key="done")
    migrate("0023_step_ids_in_time_order")  # no checkpoint yet: back and forth
    migrate_to_latest()
    assert chain.checkpoint_take() is not None

    with pytest.raises(RuntimeError, match="packed listings"):
        migrate("0023_step_ids_in_time_order")
    migrate_to_latest()
    out = StringIO()
    call_command("verify_ledger", stdout=out)
    assert ", 0 broken" in out.getvalue()
