"""The step page: what was asked, what the tool declares, what happened, what can be decided."""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.test import Client
from django.urls import reverse

from executor.ledger.records import Agent, Run
from tests.support.console import (
    blocked,
    compensation,
    completed,
    dead,
    htmx,
    planned,
    post,
    read,
    unknown,
)

pytestmark = pytest.mark.usefixtures("tools")


def page_of(client: Client, step: Any) -> Any:
    response = client.get(reverse("step", args=[step.pk]))
    assert response.status_code == 200
    return response


def decision_forms(response: Any) -> set[str]:
    return {
        f.attrs["data-testid"].removeprefix("decision-")
        for f in read(response).forms
        if f.attrs.get("data-testid", "").startswith("decision-")
    }


def test_the_page_shows_the_input_summary_and_never_a_redacted_field(
    bob: Client, agent: Agent, run: Run
) -> None:
    step = post(agent, run, "console.secret", "login", user="ada", password="hunter2-secret")
    response = page_of(bob, step)
    body = response.content.decode()
    assert "ada" in read(response).text
    assert "hunter2-secret" not in body
    # DESIGN.md §15: "[redacted]" stands in place of the value.
    assert "[redacted]" in read(response).text


def test_the_tool_declarations_are_shown(bob: Client, agent: Agent, run: Run) -> None:
    step = unknown(agent, run, tool="console.lookup")
    text = read(page_of(bob, step)).text
    assert "Effect write" in text
    assert "Idempotency none" in text
    assert "Lookup yes, authoritative" in text
    assert "Compensation irreversible" in text


def test_a_tool_with_a_compensation_names_it(bob: Client, agent: Agent, run: Run) -> None:
    step = completed(agent, run)
    page = read(page_of(bob, step))
    assert "Compensation console.undo" in page.text
    assert "irreversible" not in page.testids()


def test_the_timeline_merges_events_and_attempts_in_time_order(
    bob: Client, agent: Agent, run: Run
) -> None:
    step = unknown(agent, run)
    response = page_of(bob, step)
    timeline = re.search(
        r'data-testid="timeline".*?</section>', response.content.decode(), re.S
    ).group(0)
    items = re.findall(r'data-testid="timeline-(event|attempt)"', timeline)
    # posted (approved by policy, pending), claimed; the attempt; then unknown.
    assert items == ["event", "event", "attempt", "event"]
    text = " ".join(re.sub(r"<[^>]+>", " ", timeline).split())
    assert "Attempt 1" in text
    assert "fence 1" in text
    assert "console-test-worker" in text
    assert "ambiguous: connection dropped" in text
    assert text.index("running") < text.index("Attempt 1") < text.rindex("unknown")
    # The post's one Event shows the states it passed through.
    assert "new → planned → approved → pending agent:" in text


def test_times_read_relative_and_name_the_absolute_time(
    bob: Client, agent: Agent, run: Run
) -> None:
    step = planned(agent, run)
    body = page_of(bob, step).content.decode()
    assert re.search(
        r'<time datetime="[0-9T:.+-]+" title="[0-9-]+ [0-9:]+ UTC">just now</time>', body
    )


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda a, r: unknown(a, r), {"resolve-happened", "resolve-give-up"}),
        (
            lambda a, r: unknown(a, r, tool="console.lookup"),
            {"resolve-happened", "resolve-run-again", "resolve-give-up", "probe"},
        ),
        (lambda a, r: planned(a, r), {"approve", "reject"}),
        (lambda a, r: completed(a, r), {"compensate"}),
        (lambda a, r: completed(a, r, tool="console.undo"), set()),
        (lambda a, r: dead(a, r), {"replay"}),
        (lambda a, r: blocked(a, r), {"resume"}),
    ],
    ids=[
        "unknown",
        "unknown-with-lookup",
        "planned",
        "completed",
        "completed-irreversible",
        "dead",
        "blocked",
    ],
)
def test_the_decisions_offered_fit_the_state(
    bob: Client, agent: Agent, run: Run, make: Any, expected: set[str]
) -> None:
    step = make(agent, run)
    assert decision_forms(page_of(bob, step)) == expected


def test_running_again_is_not_offered_for_a_write_that_cannot_be_checked(
    bob: Client, agent: Agent, run: Run
) -> None:
    step = unknown(agent, run)
    text = read(page_of(bob, step)).text
    assert "Running it again is not offered" in text


def test_an_irreversible_step_says_so_instead_of_offering_compensation(
    bob: Client, agent: Agent, run: Run
) -> None:
    step = completed(agent, run, tool="console.undo")
    text = read(page_of(bob, step)).text
    assert "Irreversible: console.undo declares no compensation." in text


def test_a_compensation_step_shows_what_it_undoes(
    bob: Client, owner: Any, agent: Agent, run: Run
) -> None:
    comp = compensation(agent, run, owner)
    page = read(page_of(bob, comp))
    assert "Undoes undo-me" in page.text
    assert decision_forms(page_of(bob, comp)) == {"approve", "reject"}
    assert page.form("decision-approve").buttons == ["Approve this compensation"]


def test_who_asked_for_a_compensation_is_not_offered_its_approval(
    bob: Client, reviewer: Any, agent: Agent, run: Run
) -> None:
    comp = compensation(agent, run, reviewer)
    page = read(page_of(bob, comp))
    assert "bob" in page.text  # the "asked by" heading
    assert decision_forms(page_of(bob, comp)) == {"reject"}
    assert "decision-approve-unavailable" in page.testids()
    assert "You requested this step yourself: another reviewer must approve it" in page.text


def test_every_decision_form_posts_with_csrf_a_labelled_reason_and_the_version(
    bob: Client, agent: Agent, run: Run
) -> None:
    step = unknown(agent, run, tool="console.lookup")
    page = read(page_of(bob, step))
    forms = [f for f in page.forms if f.attrs.get("data-testid", "").startswith("decision-")]
    assert len(forms) == 4
    for form in forms:
        assert form.attrs["method"] == "post"
        assert form.attrs["hx-post"] == form.attrs["action"]
        assert form.field("csrfmiddlewaretoken")
        reason = form.field("reason")
        assert reason is not None
        assert reason["tag"] == "textarea"
        assert "required" in reason
        assert page.label_for(reason["id"]).startswith("Reason")
        version = form.field("version")
        assert version == {**version, "type": "hidden", "value": str(step.version)}
        assert len(form.buttons) == 1
        assert form.buttons[0]


def test_the_it_happened_form_asks_for_the_external_id_and_evidence(
    bob: Client, agent: Agent, run: Run
) -> None:
    step = unknown(agent, run)
    page = read(page_of(bob, step))
    form = page.form("decision-resolve-happened")
    assert page.label_for(form.field("external_id")["id"]) == "External id"
    assert page.label_for(form.field("evidence")["id"]) == "Evidence"
    assert form.attrs["action"] == reverse("step_decide", args=[step.pk, "resolve-happened"])


def test_a_reviewer_without_the_permission_sees_why_instead_of_a_form(
    dave: Client, agent: Agent, run: Run
) -> None:
    step = planned(agent, run)
    response = page_of(dave, step)
    page = read(response)
    assert decision_forms(response) == set()
    assert {"decision-approve-unavailable", "decision-reject-unavailable"} <= page.testids()
    assert "You need the approve_steps permission on acme." in page.text


def test_htmx_gets_only_the_step_region(bob: Client, agent: Agent, run: Run) -> None:
    step = planned(agent, run)
    response = bob.get(reverse("step", args=[step.pk]), **htmx(target="step"))
    body = response.content.decode()
    assert response.status_code == 200
    assert "<html" not in body
    assert body.lstrip().startswith('<div id="step"')
    assert "HX-Request" in response["Vary"]


def test_the_region_urls_render_the_decisions_and_the_timeline(
    bob: Client, agent: Agent, run: Run
) -> None:
    step = dead(agent, run)
    decisions = bob.get(reverse("step_decisions", args=[step.pk]))
    timeline = bob.get(reverse("step_timeline", args=[step.pk]))
    assert decisions.status_code == timeline.status_code == 200
    assert decisions.content.decode().lstrip().startswith('<section id="step-decisions"')
    assert read(decisions).form("decision-replay") is not None
    assert timeline.content.decode().lstrip().startswith('<section id="step-timeline"')
    assert "transient: 3 attempts failed" in read(timeline).text


def test_a_timeline_poll_reloads_the_page_once_the_step_changed_state(
    bob: Client, agent: Agent, run: Run
) -> None:
    step = post(agent, run, "console.ticket", "moving")
    url = reverse("step_timeline", args=[step.pk])
    same = bob.get(f"{url}?seen=pending", **htmx())
    moved = bob.get(f"{url}?seen=planned", **htmx())
    assert "HX-Refresh" not in same
    assert moved["HX-Refresh"] == "true"


def test_the_step_page_works_without_javascript(bob: Client, agent: Agent, run: Run) -> None:
    step = dead(agent, run)
    page = read(page_of(bob, step))
    for tag, attrs in page.elements:
        if "hx-get" in attrs and tag == "a":
            assert attrs.get("href"), attrs
        if "hx-post" in attrs:
            assert tag == "form"
            assert attrs["action"] == attrs["hx-post"]
