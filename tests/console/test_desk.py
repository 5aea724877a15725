"""The review desk a team works all day (issue 23.3): search, sort, pages, bulk approve and
reject with a result per step, claims, the decisions page and its CSV, the live step page,
repeated attempts grouped, blocked reasons, and free text through redaction."""

from __future__ import annotations

import csv
import io
import re
from datetime import timedelta
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from django.contrib.auth.models import User
from django.test import AsyncClient, Client
from django.urls import reverse
from django.utils import timezone

from executor.ledger import selectors
from executor.ledger.records import Agent, Attempt, Event, Run, Step, StepClaim
from executor.ledger.selectors import TimelineEntry
from executor.ledger.states import State
from executor.services import decisions
from executor.services.accounts import reviewer_create
from executor.services.reviews import deadletter_replay, step_approve, step_reject
from executor.services.rules import rules_load
from tests.support.console import (
    age,
    blocked,
    bulk_steps,
    compensation,
    dead,
    htmx,
    planned,
    read,
    reload,
    signed_in,
    unknown,
)

pytestmark = pytest.mark.usefixtures("tools")


def listed(response: Any) -> list[str]:
    return re.findall(r'class="step-key">([^<]+)<', response.content.decode())


def inbox(client: Client, **params: Any) -> Any:
    response = client.get(reverse("inbox"), params)
    assert response.status_code == 200
    return response


@pytest.fixture
def erin(workspace: Any) -> User:
    return reviewer_create(workspace=workspace, username="erin", password="erin-pw")


@pytest.fixture
def erin_client(erin: User) -> Client:
    return signed_in(erin)


# --- search, sort, pages ------------------------------------------------------------------


@pytest.fixture
def desk_steps(agent: Agent, run: Run) -> dict[str, Step]:
    steps = {
        "refund": planned(agent, run, key="refund-4411"),
        "mail": unknown(agent, run, key="mail-customer"),
        "hook": dead(agent, run, key="partner-hook"),
    }
    Step.objects.filter(pk=steps["refund"].pk).update(input_summary="refund order 4411 of 120 EUR")
    Step.objects.filter(pk=steps["mail"].pk).update(external_id="MSG-77")
    for n, step in enumerate(steps.values()):
        age(step, timedelta(minutes=30 - n))
    return {name: reload(step) for name, step in steps.items()}


def test_search_finds_a_step_by_key_ids_tool_and_summary(
    bob: Client, desk_steps: dict[str, Step]
) -> None:
    refund, mail = desk_steps["refund"], desk_steps["mail"]
    assert listed(inbox(bob, q="refund-44")) == ["refund-4411"]
    assert listed(inbox(bob, q="ORDER 4411")) == ["refund-4411"]  # summary, any case
    assert listed(inbox(bob, q="MSG-77")) == ["mail-customer"]  # external id
    assert listed(inbox(bob, q=str(mail.operation_id))) == ["mail-customer"]
    assert listed(inbox(bob, q=str(refund.pk))) == ["refund-4411"]  # the step's own id
    assert listed(inbox(bob, q=str(mail.operation_id)[:13])) == ["mail-customer"]
    assert listed(inbox(bob, q="console.gated")) == ["refund-4411"]  # the tool
    nothing = inbox(bob, q="no such thing")
    assert listed(nothing) == []
    assert "Nothing matches these filters" in nothing.content.decode()


def test_search_counts_agree_with_the_rows_and_the_search_stays_in_the_form(
    bob: Client, desk_steps: dict[str, Step]
) -> None:
    page = read(inbox(bob, q="refund"))
    assert page.form("inbox-filters").field("q")["value"] == "refund"
    body = inbox(bob, q="refund").content.decode()
    assert re.search(r'data-testid="inbox-total">1<', body)
    assert re.search(r'data-testid="tab-all".*?<span class="count">1</span>', body, re.S)


def test_sorts_order_the_rows(bob: Client, desk_steps: dict[str, Step]) -> None:
    assert listed(inbox(bob)) == ["refund-4411", "mail-customer", "partner-hook"]
    assert listed(inbox(bob, sort="newest")) == ["partner-hook", "mail-customer", "refund-4411"]
    assert listed(inbox(bob, sort="key")) == ["mail-customer", "partner-hook", "refund-4411"]
    by_tool = listed(inbox(bob, sort="tool"))
    assert by_tool[0] == "refund-4411"  # console.gated before console.ticket
    assert listed(inbox(bob, sort="bogus")) == listed(inbox(bob))  # ignored, not failed


def follow(client: Client, body: str, testid: str) -> Any:
    link = re.search(rf'<a href="([^"]+)"[^>]*data-testid="{testid}"', body)
    assert link, testid
    response = client.get(link.group(1).replace("&amp;", "&"))
    assert response.status_code == 200
    return response


@pytest.mark.parametrize("sort", ["oldest", "newest", "tool", "key"])
def test_pages_go_forward_and_back_with_a_count(bob: Client, run: Run, sort: str) -> None:
    bulk_steps(run, 7)
    first = inbox(bob, size=3, sort=sort)
    body = first.content.decode()
    assert re.search(r'data-testid="page-number">1<.*data-testid="page-count">3<', body, re.S)
    assert 'data-testid="previous-page"' not in body
    second = follow(bob, body, "next-page")
    third = follow(bob, second.content.decode(), "next-page")
    assert 'data-testid="next-page"' not in third.content.decode()
    assert 'data-testid="page-number">3<' in third.content.decode()
    seen = listed(first) + listed(second) + listed(third)
    assert sorted(seen) == sorted(f"bulk-{n}" for n in range(1, 8))
    back = follow(bob, third.content.decode(), "previous-page")
    assert listed(back) == listed(second)
    assert 'data-testid="page-number">2<' in back.content.decode()
    assert listed(follow(bob, back.content.decode(), "previous-page")) == listed(first)


# --- bulk approve and reject --------------------------------------------------------------


def pick(*steps: Step) -> list[str]:
    return [f"{step.pk}:{step.version}" for step in steps]


def bulk(client: Client, steps: list[str], decision: str, reason: str = "checked") -> Any:
    return client.post(
        reverse("steps_bulk_decide"),
        {"steps": steps, "decision": decision, "reason": reason},
        **htmx(target="inbox-list", current_url="/"),
    )


def outcomes(response: Any) -> dict[str, str]:
    body = response.content.decode()
    return dict(
        re.findall(r'data-testid="bulk-result" data-step="([^"]+)" data-outcome="(\w+)"', body)
    )


def test_bulk_approval_lands_each_step_and_names_the_stale_one(
    bob: Client, erin: User, agent: Agent, run: Run
) -> None:
    steps = [planned(agent, run, key=f"refund-{n}") for n in range(4)]
    seen = pick(*steps)
    # erin rejects one after bob loaded the page: bob's version of it is stale.
    step_reject(step=steps[2], user=erin, version=steps[2].version, reason="duplicate")
    response = bulk(bob, seen, "approve", "all four checked against the orders")
    assert response.status_code == 200
    assert "inbox-changed" in response["HX-Trigger"]
    found = outcomes(response)
    assert found == {
        str(steps[0].pk): "approved",
        str(steps[1].pk): "approved",
        str(steps[2].pk): "stale",
        str(steps[3].pk): "approved",
    }
    body = response.content.decode()
    stale = re.search(rf'data-step="{steps[2].pk}".*?</li>', body, re.S).group(0)
    assert "refund-2" in stale
    assert "Already handled by user:erin" in stale
    assert [reload(s).state for s in steps] == [
        State.PENDING,
        State.PENDING,
        State.REJECTED,
        State.PENDING,
    ]
    # Each approval recorded bob's reason on its own event.
    assert (
        Event.objects.filter(
            actor="user:bob", to_state=State.APPROVED, reason="all four checked against the orders"
        ).count()
        == 3
    )


def test_bulk_rejection_with_one_reason(bob: Client, agent: Agent, run: Run) -> None:
    steps = [planned(agent, run, key=f"mail-{n}") for n in range(3)]
    response = bulk(bob, pick(*steps), "reject", "wrong recipients")
    assert response.status_code == 200
    assert set(outcomes(response).values()) == {"rejected"}
    assert {reload(s).state for s in steps} == {State.REJECTED}
    assert set(Event.objects.filter(to_state=State.REJECTED).values_list("reason", flat=True)) == {
        "wrong recipients"
    }


def test_bulk_approval_keeps_four_eyes_per_step(
    bob: Client, owner: User, reviewer: User, agent: Agent, run: Run
) -> None:
    theirs = planned(agent, run, key="theirs")
    own = compensation(agent, run, reviewer, key="undo-mine")  # bob asked for it himself
    response = bulk(bob, pick(theirs, own), "approve")
    assert outcomes(response) == {str(theirs.pk): "approved", str(own.pk): "not_permitted"}
    assert "you requested this step yourself" in response.content.decode()
    assert reload(own).state == State.PLANNED


def test_a_reviewer_without_the_approve_right_cannot_bulk_approve(
    dave: Client, agent: Agent, run: Run
) -> None:
    step = planned(agent, run, key="refund")
    assert "bulk-decide-form" not in read(inbox(dave)).testids()
    response = bulk(dave, pick(step), "approve")
    assert response.status_code == 403
    assert "approve_steps" in response.content.decode()
    assert reload(step).state == State.PLANNED


def test_an_outsider_cannot_bulk_decide_another_workspaces_steps(
    charlie: Client, agent: Agent, run: Run
) -> None:
    step = planned(agent, run, key="refund")
    assert bulk(charlie, pick(step), "approve").status_code == 404
    assert reload(step).state == State.PLANNED


def test_bulk_input_that_is_not_a_decision_is_refused(bob: Client, agent: Agent, run: Run) -> None:
    step = planned(agent, run, key="refund")
    assert bulk(bob, pick(step), "delete").status_code == 422
    assert bulk(bob, ["nonsense"], "approve").status_code == 422
    assert bulk(bob, pick(step), "approve", reason="").status_code == 422
    assert reload(step).state == State.PLANNED


def test_a_first_of_two_approvals_is_reported_waiting_not_approved(
    reviewer: User, agent: Agent, run: Run
) -> None:
    """A require_two rule (docs/rules.md): the first reviewer's approval leaves the step
    planned, and the bulk result says so, with the service's own words."""
    rules_load(
        tables=[{"tool": "console.gated", "when": "true", "action": "require_two", "reason": "two"}]
    )
    step = planned(agent, run, key="big-refund")
    (result,) = decisions.decide_many(
        name="approve", steps=[(step, step.version)], user=reviewer, reason="ok"
    )
    assert result.outcome == decisions.BulkOutcome.WAITING
    assert not result.landed
    assert "second" in result.message.lower() or "another" in result.message.lower()
    assert Step.objects.get(pk=step.pk).state == State.PLANNED


# --- claims -------------------------------------------------------------------------------


def test_a_claim_is_shown_to_the_others_and_refuses_a_second_claim(
    bob: Client, erin_client: Client, agent: Agent, run: Run
) -> None:
    step = planned(agent, run, key="refund")
    response = bob.post(reverse("step_claim", args=[step.pk]), **htmx(target="step"))
    assert response.status_code == 200
    assert "Being handled by you" in response.content.decode()
    row = re.search(r'data-testid="claimed-by">([^<]+)<', inbox(erin_client).content.decode())
    assert row.group(1) == "being handled by bob"
    page = erin_client.get(reverse("step", args=[step.pk])).content.decode()
    assert "Being handled by bob" in page
    again = erin_client.post(reverse("step_claim", args=[step.pk]), **htmx(target="step"))
    assert again.status_code == 409
    assert "This step is being handled by bob until" in again.content.decode()
    # Only bob releases his claim; then erin may take it.
    assert erin_client.post(reverse("step_release", args=[step.pk])).status_code == 302
    assert StepClaim.objects.get(step=step).user.username == "bob"
    bob.post(reverse("step_release", args=[step.pk]))
    assert not StepClaim.objects.filter(step=step).exists()
    assert erin_client.post(reverse("step_claim", args=[step.pk])).status_code == 302
    assert StepClaim.objects.get(step=step).user.username == "erin"


def test_a_lapsed_claim_shows_no_more_and_is_taken_over(
    bob: Client, erin_client: Client, settings: Any, agent: Agent, run: Run
) -> None:
    step = planned(agent, run, key="refund")
    bob.post(reverse("step_claim", args=[step.pk]))
    StepClaim.objects.filter(step=step).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert 'data-testid="claimed-by"' not in inbox(erin_client).content.decode()
    assert erin_client.post(reverse("step_claim", args=[step.pk])).status_code == 302
    claim = StepClaim.objects.get(step=step)
    assert claim.user.username == "erin"
    expected = timedelta(minutes=settings.REVIEW_CLAIM_MINUTES)
    assert abs((claim.expires_at - claim.claimed_at) - expected) < timedelta(seconds=1)


def test_a_decision_ends_the_claim(bob: Client, reviewer: User, agent: Agent, run: Run) -> None:
    step = planned(agent, run, key="refund")
    bob.post(reverse("step_claim", args=[step.pk]))
    bob.post(
        reverse("step_decide", args=[step.pk, "approve"]),
        {"version": step.version, "reason": "fine"},
    )
    assert reload(step).state == State.PENDING
    assert not StepClaim.objects.filter(step=step).exists()


def test_claims_are_refused_to_outsiders_and_on_steps_that_wait_for_nobody(
    bob: Client, charlie: Client, agent: Agent, run: Run
) -> None:
    step = planned(agent, run, key="refund")
    assert charlie.post(reverse("step_claim", args=[step.pk])).status_code == 404
    assert charlie.post(reverse("step_release", args=[step.pk])).status_code == 404
    assert bob.get(reverse("step_claim", args=[step.pk])).status_code == 405
    step_reject(step=step, user=User.objects.get(username="bob"), version=1, reason="x")
    refused = bob.post(reverse("step_claim", args=[step.pk]), **htmx(target="step"))
    assert refused.status_code == 409
    assert "nothing waits for a person" in refused.content.decode().lower()


# --- the live step page -------------------------------------------------------------------


def test_the_step_page_answers_204_until_someone_decides_then_redraws(
    bob: Client, erin: User, agent: Agent, run: Run
) -> None:
    step = planned(agent, run, key="refund")
    page = bob.get(reverse("step", args=[step.pk])).content.decode()
    poll = re.search(r'hx-get="([^"]*/live/[^"]*)"', page).group(1).replace("&amp;", "&")
    assert re.search(r'hx-trigger="every \d+s"', page)
    quiet = bob.get(poll, **htmx(target="step"))
    assert quiet.status_code == 204
    step_approve(step=step, user=erin, version=step.version, reason="fine by me")
    changed = bob.get(poll, **htmx(target="step"))
    assert changed.status_code == 200
    assert "inbox-changed" in changed["HX-Trigger"]
    body = changed.content.decode()
    assert body.lstrip().startswith('<div id="step"')
    assert 'data-testid="decision-approve"' not in body
    assert "fine by me" in body


def test_a_new_claim_redraws_only_the_claim_bar(
    bob: Client, erin_client: Client, agent: Agent, run: Run
) -> None:
    step = planned(agent, run, key="refund")
    page = bob.get(reverse("step", args=[step.pk])).content.decode()
    poll = re.search(r'hx-get="([^"]*/live/[^"]*)"', page).group(1).replace("&amp;", "&")
    erin_client.post(reverse("step_claim", args=[step.pk]))
    answer = bob.get(poll, **htmx(target="step"))
    assert answer.status_code == 200
    assert answer["HX-Reswap"] == "none"
    body = answer.content.decode()
    assert 'hx-swap-oob="true"' in body
    assert "Being handled by erin" in body


def test_the_list_region_brings_the_navigation_counts_from_the_same_query(
    bob: Client, agent: Agent, run: Run
) -> None:
    planned(agent, run, key="a")
    dead(agent, run, key="b")
    body = bob.get(reverse("inbox"), **htmx(target="inbox-list")).content.decode()
    nav = re.search(r'<span id="nav-counts"[^>]*hx-swap-oob="true"[^>]*>(.*?)</span>', body, re.S)
    assert nav
    total = re.search(r'data-testid="nav-count-total"[^>]*>(\d+)<', body).group(1)
    tab = re.search(r'data-testid="tab-all".*?<span class="count">(\d+)</span>', body, re.S)
    assert total == tab.group(1) == "2"


# --- the step page: blocked reasons, grouped attempts, redaction --------------------------


def test_a_blocked_steps_reason_is_in_its_summary_and_its_row(
    bob: Client, agent: Agent, run: Run
) -> None:
    step = blocked(agent, run, key="stuck")
    page = bob.get(reverse("step", args=[step.pk])).content.decode()
    reason = re.search(r'data-testid="blocked-reason">([^<]+)<', page).group(1)
    assert "may no longer use console.ticket" in reason
    row = re.search(r'data-testid="blocked-reason">([^<]+)<', inbox(bob).content.decode())
    assert "may no longer use console.ticket" in row.group(1)


def test_reasons_on_pages_pass_through_redaction(
    bob: Client, reviewer: User, agent: Agent, run: Run
) -> None:
    step = planned(agent, run, key="refund")
    secret = "ghp_" + "A1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q7r8"
    step_reject(step=step, user=reviewer, version=step.version, reason=f"token leaked: {secret}")
    for url in (reverse("step", args=[step.pk]), reverse("decisions")):
        body = bob.get(url).content.decode()
        assert secret not in body
        assert "[redacted]" in body
    exported = b"".join(bob.get(reverse("decisions"), {"format": "csv"}).streaming_content)
    assert secret.encode() not in exported


def attempt(number: int, error: str = "transient", message: str = "503") -> TimelineEntry:
    at = timezone.now() + timedelta(seconds=number)
    row = Attempt(number=number, fence=number, phase="errored", error_class=error)
    row.error_message = message
    return TimelineEntry(at=at, attempt=row)


def move(seq: int, src: str, dst: str, actor: str = "executor:w") -> TimelineEntry:
    at = timezone.now() + timedelta(seconds=seq)
    return TimelineEntry(at=at, event=Event(seq=seq, from_state=src, to_state=dst, actor=actor))


def test_repeated_failed_attempts_are_grouped_in_the_timeline() -> None:
    entries = [
        move(1, "", "pending", actor="agent:a"),
        move(2, "pending", "running"),
        attempt(1, "invalid_input"),
        move(3, "running", "pending"),
        move(4, "pending", "running"),
        attempt(2),
        move(5, "running", "pending"),
        move(6, "pending", "running"),
        attempt(3),
        move(7, "running", "pending"),
        move(8, "pending", "running"),
        attempt(4, message="503 again"),
        move(9, "running", "dead"),
    ]
    grouped = selectors.group_retries(entries)
    kinds = [entry.kind for entry in grouped]
    assert kinds == ["event", "event", "attempt", "event", "event", "group", "event"]
    group = grouped[5]
    assert (group.first_number, group.last_number) == (2, 4)
    assert group.error == ("transient", "503 again")
    assert grouped[-1].event is not None
    assert grouped[-1].event.to_state == "dead"
    # Nothing is lost: the group holds the attempts and moves it folded.
    assert sum(len(e.group or [e]) for e in grouped) == len(entries)


def test_a_single_failed_attempt_stays_as_it_is() -> None:
    entries = [move(1, "pending", "running"), attempt(1), move(2, "running", "dead")]
    assert [e.kind for e in selectors.group_retries(entries)] == ["event", "attempt", "event"]


def test_times_show_the_absolute_time_beside_the_relative(
    bob: Client, agent: Agent, run: Run
) -> None:
    step = planned(agent, run)
    body = bob.get(reverse("step", args=[step.pk])).content.decode()
    assert re.search(
        r'<time datetime="[^"]+" title="[0-9-]+ [0-9:]+ UTC">just now</time> '
        r'<span class="abs-time">\d{4}-\d\d-\d\d \d\d:\d\d UTC</span>',
        body,
    )


# --- the decisions page -------------------------------------------------------------------


@pytest.fixture
def decided(reviewer: User, erin: User, agent: Agent, run: Run) -> dict[str, Step]:
    a = planned(agent, run, key="refund-a")
    b = planned(agent, run, key="refund-b")
    c = dead(agent, run, key="hook-c")
    step_approve(step=a, user=reviewer, version=a.version, reason="order verified")
    step_reject(step=b, user=erin, version=b.version, reason="=HYPERLINK(evil)")
    deadletter_replay(step=c, user=erin, version=c.version, reason="partner is back")
    return {"a": a, "b": b, "c": c}


def decision_rows(response: Any) -> list[tuple[str, str]]:
    body = response.content.decode()
    people = re.findall(r'data-testid="decision-person">([^<]+)<', body)
    kinds = re.findall(r'data-testid="decision-row" data-step="[^"]+" data-kind="(\w+)"', body)
    return list(zip(people, kinds, strict=True))


def test_the_decisions_page_says_who_decided_what_and_why(
    bob: Client, decided: dict[str, Step]
) -> None:
    response = bob.get(reverse("decisions"))
    assert response.status_code == 200
    assert decision_rows(response) == [
        ("erin", "replayed"),
        ("erin", "rejected"),
        ("bob", "approved"),
    ]
    body = response.content.decode()
    assert "order verified" in body
    assert "partner is back" in body
    assert 'data-testid="decisions-total">3<' in body


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ({"person": "erin"}, [("erin", "replayed"), ("erin", "rejected")]),
        ({"kind": "approved"}, [("bob", "approved")]),
        ({"tool": "console.ticket"}, [("erin", "replayed")]),
        ({"person": "erin", "kind": "rejected"}, [("erin", "rejected")]),
    ],
)
def test_the_decisions_page_filters(
    bob: Client, decided: dict[str, Step], query: dict[str, str], expected: list[Any]
) -> None:
    assert decision_rows(bob.get(reverse("decisions"), query)) == expected


def test_the_decisions_page_filters_by_day(bob: Client, decided: dict[str, Step]) -> None:
    today = timezone.now().date()
    assert len(decision_rows(bob.get(reverse("decisions"), {"since": str(today)}))) == 3
    yesterday = today - timedelta(days=1)
    assert decision_rows(bob.get(reverse("decisions"), {"until": str(yesterday)})) == []
    Event.objects.filter(actor="user:bob").update(created_at=timezone.now() - timedelta(days=3))
    recent = bob.get(reverse("decisions"), {"since": str(yesterday), "until": str(today)})
    assert [person for person, _ in decision_rows(recent)] == ["erin", "erin"]


@pytest.mark.parametrize(
    "query",
    [
        {"until": "9999-12-31"},
        {"since": "0001-01-01"},
        {"until": "garbage"},
        {"since": "2026-02-30"},
        {"person": "nobody"},
        {"kind": "x"},
        {"after": "%%%"},
    ],
)
def test_bad_decisions_filters_are_ignored_with_a_message_and_a_csv_is_refused(
    bob: Client, decided: dict[str, Step], query: dict[str, str]
) -> None:
    page = bob.get(reverse("decisions"), query)
    assert page.status_code == 200
    assert len(decision_rows(page)) == 3
    if "after" not in query:
        assert 'data-testid="filter-problem"' in page.content.decode()
        exported = bob.get(reverse("decisions"), {**query, "format": "csv"})
        assert exported.status_code == 400
        assert "Nothing exported" in exported.content.decode()


def test_the_csv_export_streams_every_decision_safe_for_spreadsheets(
    bob: Client, decided: dict[str, Step]
) -> None:
    response = bob.get(reverse("decisions"), {"format": "csv", "person": "erin"})
    assert response.status_code == 200
    assert response.streaming
    assert response["Content-Type"] == "text/csv; charset=utf-8"
    assert "attachment" in response["Content-Disposition"]
    rows = list(csv.DictReader(io.StringIO(b"".join(response.streaming_content).decode())))
    assert [(r["person"], r["decision"], r["step_key"]) for r in rows] == [
        ("erin", "replayed", "hook-c"),
        ("erin", "rejected", "refund-b"),
    ]
    assert rows[1]["reason"] == "'=HYPERLINK(evil)"  # a formula would run in a spreadsheet
    assert rows[0]["tool"] == "console.ticket"


def test_the_csv_export_reads_in_chunks(
    bob: Client, reviewer: User, agent: Agent, run: Run
) -> None:
    steps = [planned(agent, run, key=f"r-{n}") for n in range(5)]
    for step in steps:
        step_reject(step=step, user=reviewer, version=step.version, reason="no")
    chunks = list(
        selectors.decisions_chunks(
            decisions=selectors.DecisionFilter(workspace_ids=(run.workspace_id,)), chunk=2
        )
    )
    assert [len(chunk) for chunk in chunks] == [2, 2, 1]
    assert len({e.pk for chunk in chunks for e in chunk}) == 5


def test_the_csv_export_streams_asynchronously_under_asgi(
    reviewer: User, decided: dict[str, Step]
) -> None:
    client = AsyncClient()

    async def fetch() -> tuple[Any, bytes]:
        await client.aforce_login(reviewer)
        response = await client.get(reverse("decisions"), {"format": "csv"})
        body = b"".join([part async for part in response.streaming_content])
        return response, body

    response, body = async_to_sync(fetch)()
    assert response.status_code == 200
    # An async iterator: served as it is read, not read whole first (Django's warning).
    assert response.is_async
    assert body.decode().count("\r\n") == 4  # the header and three decisions


def test_outsiders_see_no_decisions_of_other_workspaces(
    charlie: Client, decided: dict[str, Step]
) -> None:
    response = charlie.get(reverse("decisions"))
    assert response.status_code == 200
    assert decision_rows(response) == []
    exported = b"".join(charlie.get(reverse("decisions"), {"format": "csv"}).streaming_content)
    assert exported.decode().count("\r\n") == 1


def test_the_desk_pages_need_a_sign_in(client: Client, agent: Agent, run: Run) -> None:
    step = planned(agent, run)
    for url in (
        reverse("decisions"),
        reverse("step_live", args=[step.pk]),
    ):
        response = client.get(url)
        assert response.status_code == 302
        assert "/accounts/login/" in response["Location"]
    assert client.post(reverse("step_claim", args=[step.pk])).status_code == 302
    assert client.post(reverse("steps_bulk_decide")).status_code == 302
