"""The run report: every section, the summary line, and usage reconciled against the
attempts and against the desk's own count of tickets."""

from __future__ import annotations

from typing import Any

import pytest
from django.db.models import F

from executor import engine
from executor.ledger import selectors, transitions
from executor.ledger.records import Agent, Run, Step
from executor.ledger.states import State
from executor.services.posting import step_post


def post(agent: Agent, run: Run, key: str, tool: str = "echo", **body: Any) -> Step:
    step, _ = step_post(agent=agent, run=run, key=key, tool_name=tool, input=body or {"n": key})
    return step


def keys(report: dict[str, Any], section: str) -> list[str]:
    return [entry["key"] for entry in report[section]]


def test_each_step_lands_in_its_section_with_its_evidence(agent: Agent, run: Run) -> None:
    done = post(agent, run, "done")
    engine.process(done.pk, worker="w")
    post(agent, run, "waiting")
    cancelled = post(agent, run, "cancelled")
    transitions.move(cancelled, State.CANCELLED, actor="test")
    maybe = post(agent, run, "maybe")
    transitions.move(
        maybe,
        State.RUNNING,
        actor="test",
        changes={"lease_owner": "w", "lease_expires_at": maybe.created_at, "fence": 1},
    )
    transitions.move(maybe, State.UNKNOWN, actor="test", changes={"failure_class": "ambiguous"})

    report = selectors.run_report(run=run)

    assert keys(report, "completed") == ["done"]
    assert report["completed"][0]["evidence"] == {"attempts": 1}
    assert keys(report, "pending") == ["waiting"]
    assert keys(report, "failed") == ["cancelled"]
    assert keys(report, "uncertain") == ["maybe"]
    assert report["uncertain"][0]["evidence"]["failure"]["class"] == "ambiguous"
    assert report["compensated"] == []
    assert report["summary"] == (
        "1 completed, 1 uncertain, 1 failed, 1 pending; "
        "may or may not have happened: `maybe`; a reviewer has it."
    )


def test_usage_agrees_with_the_attempts(agent: Agent, run: Run) -> None:
    for number in range(3):
        engine.process(post(agent, run, f"s{number}").pk, worker="w")

    usage = selectors.run_report(run=Run.objects.get(pk=run.pk))["usage"]

    assert usage["calls"] == usage["attempts"]["calls"] == 3
    assert usage["reconciled"] == {"calls": True, "cost": True}


def test_a_counter_out_of_step_with_the_attempts_is_shown(agent: Agent, run: Run) -> None:
    engine.process(post(agent, run, "s").pk, worker="w")
    Run.objects.filter(pk=run.pk).update(used_calls=F("used_calls") + 1)

    usage = selectors.run_report(run=Run.objects.get(pk=run.pk))["usage"]

    assert (usage["calls"], usage["attempts"]["calls"]) == (2, 1)
    assert usage["reconciled"]["calls"] is False


@pytest.mark.usefixtures("desk_settings")
def test_the_desks_own_count_reconciles_with_the_ledger(agent: Agent, run: Run) -> None:
    for number in range(2):
        step = post(agent, run, f"t{number}", "ticketdesk.create", title=f"ticket {number}")
        engine.process(step.pk, worker="w")

    external = selectors.run_report(run=run, external=True)["usage"]["external"]

    assert external["ticketdesk.create"] == {
        "confirmed_in_ledger": 2,
        "unknown_in_ledger": 0,
        "counted_by_system": 2,
        "duplicates": [],
        "confirmed_but_not_found": [],
        "agrees": True,
    }


@pytest.mark.usefixtures("desk_settings")
def test_a_duplicate_at_the_desk_breaks_the_agreement(
    agent: Agent, run: Run, request: pytest.FixtureRequest
) -> None:
    the_desk = request.getfixturevalue("desk")
    step = post(agent, run, "t", "ticketdesk.create", title="once")
    engine.process(step.pk, worker="w")
    # A second ticket for the same operation, as a blind retry would have made.
    the_desk.client.post(
        "/tickets", json={"title": "again", "client_ref": str(step.operation_id)}
    ).raise_for_status()

    external = selectors.run_report(run=run, external=True)["usage"]["external"]

    assert external["ticketdesk.create"]["duplicates"] == ["t"]
    assert external["ticketdesk.create"]["agrees"] is False


def test_the_api_reconciles_against_the_desk_only_when_asked(
    api: Any, run: Run, agent: Agent
) -> None:
    engine.process(post(agent, run, "s").pk, worker="w")

    plain = api.get(f"/api/v1/runs/{run.pk}/report").json()
    asked = api.get(f"/api/v1/runs/{run.pk}/report?reconcile=true").json()

    assert "external" not in plain["usage"]
    assert asked["usage"]["external"] == {}  # echo keeps no count of its own
    assert plain["usage"]["reconciled"] == {"calls": True, "cost": True}


@pytest.mark.usefixtures("desk_settings")
def test_the_console_run_page_shows_the_reconciliation_on_request(
    agent: Agent, run: Run, client: Any, reviewer: Any
) -> None:
    step = post(agent, run, "t", "ticketdesk.create", title="once")
    engine.process(step.pk, worker="w")
    client.force_login(reviewer)

    plain = client.get(f"/runs/{run.pk}/").content.decode()
    asked = client.get(f"/runs/{run.pk}/?reconcile=1").content.decode()

    # Reconciling reads every attempt of the run: on request, as the external counts are.
    assert "Calls: 1 counted" in " ".join(plain.split())
    assert "submitted attempts" not in plain
    assert "Check against the attempts and the external systems" in plain
    assert "Calls: 1 counted, 1 submitted attempts" in " ".join(asked.split())
    assert "ticketdesk.create</code>: 1 confirmed here, 0 unknown, 1 counted by the system" in (
        " ".join(asked.split())
    )
