"""Rows of several models in one statement (executor/ledger/bulk.py): values prepared as the ORM
prepares them, columns the same in every row sent once, every row stored as given."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import pytest
from django.core.exceptions import ValidationError
from django.db import connection, connections
from django.utils import timezone

from executor.ledger import bulk
from executor.ledger.records import Agent, Approval, Attempt, Event, Run, Step, StepCounter

pytestmark = pytest.mark.django_db

# Values of every kind a column of these models is given, and some it should not be.
SAMPLES: list[Any] = [
    None,
    "",
    "text",
    0,
    7,
    True,
    False,
    uuid.UUID("12345678-1234-5678-1234-567812345678"),
    "12345678-1234-5678-1234-567812345678",
    datetime(2026, 12, 1, 10, 0, tzinfo=UTC),
    {"a": [1, 2]},
    [],
    Decimal("1.50"),
    1.5,
]


def prepared(value: Any) -> Any:
    """Jsonb and other adapters compare by what they wrap."""
    return getattr(value, "obj", value)


@pytest.mark.parametrize("model", [Step, Event, Approval, Attempt, StepCounter])
def test_each_column_is_prepared_as_get_db_prep_save_prepares_it(model: Any) -> None:
    db = connections[connection.alias]
    for f in model._meta.concrete_fields:
        prepare = bulk._prepare(f, db)
        for value in SAMPLES:
            try:
                expected = f.get_db_prep_save(value, db)
            except (ValueError, TypeError, ValidationError) as error:  # so must the shortcut
                with pytest.raises(type(error)):
                    prepare(value)
                continue
            got = prepare(value)
            assert prepared(got) == prepared(expected), (f.name, value)
            assert type(prepared(got)) is type(prepared(expected)), (f.name, value)


@pytest.mark.postgres  # SQLite prepares every value through the ORM
def test_the_shortcut_is_taken_for_plain_values_on_postgresql(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    db = connections[connection.alias]
    calls: list[Any] = []
    field = Event._meta.get_field("reason")
    real = field.get_db_prep_save

    def spy(value: Any, connection: Any) -> Any:
        calls.append(value)
        return real(value, connection)

    monkeypatch.setattr(field, "get_db_prep_save", spy)
    prepare = bulk._prepare(field, db)
    assert prepare("plain") == "plain"
    assert calls == []
    assert prepare(5) == "5"  # not a str: the ORM prepares it
    assert calls == [5]


@pytest.fixture
def run(agent: Agent) -> Run:
    return Run.objects.create(workspace=agent.workspace, agent=agent, name="bulk")


def new_steps(run: Run, count: int) -> list[Step]:
    now = timezone.now()
    return [
        Step(
            run=run,
            position=index + 1,
            key=f"k{index}",
            tool_id="echo",
            input={"n": index},
            input_hash=f"{index:064d}",
            state="pending",
            created_at=now,
            updated_at=now,
        )
        for index in range(count)
    ]


@pytest.mark.postgres
def test_rows_alike_in_every_column_are_each_inserted(run: Run) -> None:
    """No column differs between the rows: no array to unnest, still one row each."""
    [step] = new_steps(run, 1)
    bulk.insert_together([bulk.Rows(Step, [step])])
    at = timezone.now()
    approvals = [
        Approval(
            step=step,
            input_hash=step.input_hash,
            tool="echo",
            policy_version="v1",
            reason="same",
            approved_at=at,
            consumed_at=at,  # used up: a step has one live approval at most
        )
        for _ in range(3)
    ]
    bulk.insert_together([bulk.Rows(Approval, approvals)])
    stored = list(Approval.objects.filter(step=step).order_by("pk"))
    assert [a.pk for a in stored] == [a.pk for a in approvals]
    assert len({a.pk for a in approvals}) == 3
    assert {(a.reason, a.policy_version, a.approved_at, a.approver_id) for a in stored} == {
        ("same", "v1", at, None)
    }


@pytest.mark.postgres
def test_columns_that_differ_and_columns_that_do_not_are_stored_as_given(run: Run) -> None:
    steps = new_steps(run, 4)
    steps[2].result = {"ok": True}  # one row differs in a nullable JSON column
    bulk.insert_together([bulk.Rows(Step, steps)])
    stored = {s.key: s for s in Step.objects.filter(run=run)}
    assert len(stored) == 4
    for step in steps:
        row = stored[step.key]
        assert (row.pk, row.position, row.input, row.input_hash, row.state) == (
            step.pk,
            step.position,
            step.input,
            step.input_hash,
            "pending",
        )
        assert row.result == step.result
    assert stored["k2"].result == {"ok": True}
    assert stored["k0"].result is None
