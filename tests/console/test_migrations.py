"""Data migrations, run on rows made by today's code: a step's "waiting since" (0006)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.utils import timezone

from executor.engine import recovery
from executor.ledger.records import Agent, Event, Run, Step
from executor.ledger.states import State
from tests.support.console import age, reload, unknown

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("tools", "back_to_latest"),
]


def migrate(target: str) -> None:
    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    executor.migrate([("executor", target)])


@pytest.fixture
def back_to_latest() -> Iterator[None]:
    yield
    executor = MigrationExecutor(connection)
    executor.migrate(executor.loader.graph.leaf_nodes("executor"))


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
