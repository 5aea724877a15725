"""Runs: the list, the run page (progress, budget, report, steps) and extending a budget."""

from __future__ import annotations

import re
from decimal import Decimal
from typing import Any

import pytest
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from console import views
from executor.ledger.records import Agent, Run, RunEvent, RunStatus
from executor.services.accounts import reviewer_create
from executor.services.reviews import step_approve
from executor.services.runs import run_cancel, run_create
from tests.support.console import (
    completed,
    dead,
    htmx,
    paused,
    planned,
    read,
    unknown,
)

pytestmark = pytest.mark.usefixtures("tools")


def run_page(client: Client, run: Run, **headers: Any) -> Any:
    response = client.get(reverse("run", args=[run.pk]), **headers)
    assert response.status_code == 200
    return response


def test_the_runs_list_shows_the_reviewers_runs_with_counts(
    bob: Client, agent: Agent, run: Run, other_agent_auth: Any
) -> None:
    completed(agent, run, key="a")
    dead(agent, run, key="b")
    run_create(agent=other_agent_auth.agent, name="globex run")
    response = bob.get(reverse("runs"))
    assert response.status_code == 200
    page = read(response)
    assert "test run" in page.text
    assert "globex run" not in page.text
    assert "1 / 2" in page.text  # steps done of all


def test_the_runs_list_filters_by_status_and_pages(bob: Client, agent: Agent) -> None:
    for n in range(5):
        run_create(agent=agent, name=f"run {n}")
    held, _ = run_create(agent=agent, name="held run")
    paused(held)
    only_paused = read(bob.get(reverse("runs") + "?status=paused"))
    assert "held run" in only_paused.text
    assert "run 3" not in only_paused.text
    first = bob.get(reverse("runs") + "?size=4")
    assert len(re.findall(r'data-testid="runs-row"', first.content.decode())) == 4
    href = re.search(r'<a href="([^"]+)" rel="next"', first.content.decode()).group(1)
    second = bob.get(href.replace("&amp;", "&"))
    assert len(re.findall(r'data-testid="runs-row"', second.content.decode())) == 2


def test_the_run_page_shows_progress_by_state(bob: Client, agent: Agent, run: Run) -> None:
    completed(agent, run, key="a")
    completed(agent, run, key="b")
    unknown(agent, run, key="c")
    planned(agent, run, key="d")
    body = run_page(bob, run).content.decode()
    segments = re.findall(r'class="seg state-(\w+)" [^>]*data-count="(\d+)"', body)
    assert segments == [("completed", "2"), ("planned", "1"), ("unknown", "1")]
    assert 'aria-label="2 completed, 1 planned, 1 unknown"' in body


def test_the_run_page_shows_budget_usage_with_numbers(bob: Client, agent: Agent) -> None:
    run, _ = run_create(agent=agent, name="bounded", max_calls=4, max_cost=Decimal(2))
    completed(agent, run, key="a")
    page = read(run_page(bob, run))
    assert "Calls 1 of 4" in page.text
    assert "Cost 0 of 2" in page.text
    assert "Time" in page.text
    assert "(no limit)" in page.text  # no deadline
    assert '<rect width="25.0" height="1">' in run_page(bob, run).content.decode()


def test_the_run_page_shows_the_report(bob: Client, agent: Agent, run: Run) -> None:
    done = completed(agent, run, key="ticket")
    unknown(agent, run, key="maybe")
    dead(agent, run, key="gone")
    response = run_page(bob, run)
    page = read(response)
    assert "1 completed, 1 uncertain, 1 failed" in page.text
    assert "may or may not have happened: maybe; a reviewer has it." in page.text
    assert {"report-completed", "report-uncertain", "report-failed"} <= page.testids()
    assert "id T-ticket" in page.text
    links = {a["href"] for tag, a in page.elements if tag == "a" and "href" in a}
    assert reverse("step", args=[done.pk]) in links


def test_the_run_page_lists_its_steps_with_links(bob: Client, agent: Agent, run: Run) -> None:
    steps = [planned(agent, run, key=f"s{n}") for n in range(3)]
    page = read(run_page(bob, run))
    links = {a["href"] for tag, a in page.elements if tag == "a" and "href" in a}
    assert {reverse("step", args=[s.pk]) for s in steps} <= links


def test_the_live_region_polls_while_the_run_is_open(bob: Client, run: Run) -> None:
    response = bob.get(reverse("run_live", args=[run.pk]))
    body = response.content.decode()
    assert body.lstrip().startswith('<div id="run-live"')
    assert 'hx-trigger="every 5s"' in body
    run_cancel(run=run, actor="agent:x")
    assert (
        'hx-trigger="every 5s"' not in bob.get(reverse("run_live", args=[run.pk])).content.decode()
    )


def test_the_live_region_carries_the_steps_table(bob: Client, agent: Agent, run: Run) -> None:
    step = planned(agent, run, key="waits")
    live = read(bob.get(reverse("run_live", args=[run.pk]), **htmx(target="run-live")))
    assert "run-steps" in live.testids()
    assert "waits" in live.text
    assert "planned" in live.text
    # The table follows the ledger at the next poll, as the report above it does.
    step_approve(
        step=step,
        user=reviewer_create(workspace=run.workspace, username="erin"),
        version=step.version,
        reason="fine",
    )
    again = read(bob.get(reverse("run_live", args=[run.pk]), **htmx(target="run-live")))
    assert "pending" in again.text
    assert "planned" not in again.text


def test_a_poll_after_the_run_changed_status_redraws_the_page(bob: Client, run: Run) -> None:
    url = reverse("run_live", args=[run.pk]) + "?seen=open"
    assert "HX-Refresh" not in bob.get(url, **htmx(target="run-live")).headers
    run_cancel(run=run, actor="agent:x")
    response = bob.get(url, **htmx(target="run-live"))
    assert response.headers["HX-Refresh"] == "true"


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [
        (0, "0 s"),
        (42.4, "42 s"),
        (59.6, "1 min"),
        (90, "2 min"),
        (3599.99, "1 h"),
        (3600, "1 h"),
        (5400, "1 h 30 min"),
        (86400, "1 d"),
        (2 * 86400 + 3 * 3600 + 20, "2 d 3 h"),
    ],
)
def test_durations_read_as_a_person_says_them(seconds: float, shown: str) -> None:
    assert views._duration(seconds) == shown


def test_an_hours_deadline_reads_one_hour(bob: Client, agent: Agent) -> None:
    run, _ = run_create(agent=agent, name="hour", deadline_seconds=3600)
    assert "of 1 h" in read(run_page(bob, run)).text


def test_htmx_gets_only_the_run_region(bob: Client, run: Run) -> None:
    body = run_page(bob, run, **htmx(target="run")).content.decode()
    assert "<html" not in body
    assert body.lstrip().startswith('<div id="run"')


# --- extending a budget -----------------------------------------------------------------------


def extend(client: Client, run: Run, **data: Any) -> Any:
    payload = {"version": run.version, "reason": "the customer approved more", **data}
    return client.post(reverse("run_extend", args=[run.pk]), payload)


def test_a_paused_run_offers_the_extend_form_to_who_may_extend(
    bob: Client, dave: Client, run: Run
) -> None:
    paused(run)
    page = read(run_page(bob, run))
    form = page.form("decision-extend")
    assert form is not None
    assert form.field("version")["value"] == str(run.version)
    assert page.label_for(form.field("reason")["id"]).startswith("Reason")
    assert page.label_for(form.field("add_calls")["id"]) == "Add calls"
    assert form.buttons == ["Extend budget"]
    limited = read(run_page(dave, run))
    assert limited.form("decision-extend") is None
    assert "decision-extend-unavailable" in limited.testids()


def test_an_open_run_offers_no_extend_form(bob: Client, run: Run) -> None:
    assert read(run_page(bob, run)).form("decision-extend") is None


def test_extending_a_budget_resumes_the_run_in_the_reviewers_name(bob: Client, run: Run) -> None:
    run = paused(run)
    response = extend(bob, run, add_calls=3, resume="on")
    assert response.status_code == 302
    run.refresh_from_db()
    assert run.status == RunStatus.OPEN
    assert run.max_calls == 5
    actions = list(
        RunEvent.objects.filter(run=run, actor="user:bob").values_list("action", flat=True)
    )
    assert actions == ["budget_extended", "resumed"]


def test_extending_without_resuming_keeps_the_run_paused(bob: Client, run: Run) -> None:
    run = paused(run)
    assert extend(bob, run, add_calls=1).status_code == 302
    run.refresh_from_db()
    assert (run.status, run.max_calls) == (RunStatus.PAUSED, 3)


def test_extending_too_little_to_resume_is_409_and_changes_nothing(bob: Client, run: Run) -> None:
    run = paused(run)
    response = extend(bob, run, add_calls=0, resume="on")
    assert response.status_code == 409
    assert "cannot resume" in read(response).text
    run.refresh_from_db()
    assert (run.status, run.max_calls) == (RunStatus.PAUSED, 2)


@pytest.mark.parametrize(
    ("field", "value", "said"),
    [
        ("add_calls", "2147483648", "at most 2,147,483,647"),
        ("add_calls", "2147483646", "at most 2,147,483,645 can be added"),
        ("add_cost", "9999999999.9999", "at most 9999999999.9999"),
        ("add_cost", "99999999999999999999", "digits"),
        ("extend_minutes", "999999999999", "at most"),
        ("extend_minutes", str(366 * 24 * 60 + 1), "at most 366 days"),
    ],
)
def test_extending_past_what_a_budget_holds_is_422_and_changes_nothing(
    bob: Client, run: Run, field: str, value: str, said: str
) -> None:
    run = paused(run)
    Run.objects.filter(pk=run.pk).update(max_cost=Decimal("1"), deadline=timezone.now())
    run.refresh_from_db()
    before = (run.max_calls, run.max_cost, run.deadline, run.version)

    response = extend(bob, run, **{field: value})

    assert response.status_code == 422
    assert said in read(response).text
    run.refresh_from_db()
    assert (run.max_calls, run.max_cost, run.deadline, run.version) == before
    assert not RunEvent.objects.filter(run=run, action="budget_extended").exists()


def test_extending_needs_extend_budget(dave: Client, run: Run) -> None:
    run = paused(run)
    response = extend(dave, run, add_calls=3, resume="on")
    assert response.status_code == 403
    run.refresh_from_db()
    assert (run.status, run.max_calls) == (RunStatus.PAUSED, 2)


def test_an_outsider_cannot_see_or_extend_a_run(charlie: Client, run: Run) -> None:
    run = paused(run)
    assert charlie.get(reverse("run", args=[run.pk])).status_code == 404
    assert charlie.get(reverse("run_live", args=[run.pk])).status_code == 404
    assert extend(charlie, run, add_calls=3, resume="on").status_code == 404
    run.refresh_from_db()
    assert run.status == RunStatus.PAUSED


def test_extending_on_a_stale_page_is_409(bob: Client, alice: Client, run: Run) -> None:
    run = paused(run)
    seen = run.version
    assert extend(alice, run, add_calls=3, resume="on").status_code == 302
    response = bob.post(
        reverse("run_extend", args=[run.pk]),
        {"version": seen, "reason": "more", "add_calls": 3, "resume": "on"},
    )
    assert response.status_code == 409
    assert "Already handled by user:alice at" in read(response).text
    run.refresh_from_db()
    assert run.max_calls == 5


def test_extending_needs_a_reason(bob: Client, run: Run) -> None:
    run = paused(run)
    response = extend(bob, run, add_calls=3, resume="on", reason="")
    assert response.status_code == 422
    assert "Give a reason" in read(response).text
    run.refresh_from_db()
    assert (run.status, run.max_calls) == (RunStatus.PAUSED, 2)


def test_a_budget_cannot_shrink(bob: Client, run: Run) -> None:
    run = paused(run)
    response = extend(bob, run, add_calls=-1, resume="on")
    assert response.status_code == 422
    run.refresh_from_db()
    assert run.max_calls == 2


def test_extending_with_htmx_redraws_the_run(bob: Client, run: Run) -> None:
    run = paused(run)
    response = bob.post(
        reverse("run_extend", args=[run.pk]),
        {"version": run.version, "reason": "more", "add_calls": 3, "resume": "on"},
        **htmx(target="run"),
    )
    assert response.status_code == 200
    body = response.content.decode()
    assert body.lstrip().startswith('<div id="run"')
    assert "Budget extended and run resumed." in read(response).text
    assert "inbox-changed" in response["HX-Trigger"]
