"""The inbox: what waits for a person, grouped, counted, filtered, paged and kept fresh."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.urls import reverse

from executor.engine import recovery
from executor.ledger.records import Agent, Run, Step
from executor.ledger.states import State
from executor.services.reviews import deadletter_replay
from executor.services.runs import run_create
from executor.services.tools import tools_sync
from tests.support.console import (
    age,
    blocked,
    bulk_steps,
    compensation,
    dead,
    events_by,
    htmx,
    paused,
    planned,
    read,
    reload,
    unchanged,
    unknown,
)

pytestmark = pytest.mark.usefixtures("tools")


def inbox(client: Client, query: str = "", **headers: Any) -> Any:
    response = client.get(reverse("inbox") + query, **headers)
    assert response.status_code == 200
    return response


def listed(response: Any) -> list[str]:
    """Step keys in the order the inbox lists them."""
    return re.findall(r'class="step-key">([^<]+)<', response.content.decode())


def tab_counts(response: Any) -> dict[str, int]:
    body = response.content.decode()
    found = re.findall(r'data-testid="tab-([a-z]+)".*?<span class="count">(\d+)</span>', body, re.S)
    return {name: int(n) for name, n in found}


@pytest.fixture
def waiting(owner: User, agent: Agent, run: Run) -> dict[str, Step]:
    """One step of each kind that waits for a person, oldest first."""
    steps = {
        "unknown": unknown(agent, run, key="u1"),
        "approval": planned(agent, run, key="p1"),
        "compensation": compensation(agent, run, owner, key="c1"),
        "dead": dead(agent, run, key="d1"),
        "blocked": blocked(agent, run, key="b1"),
    }
    for n, step in enumerate(steps.values()):
        age(step, timedelta(minutes=50 - n))
    return steps


def test_an_empty_inbox_says_nothing_waits(bob: Client) -> None:
    page = read(inbox(bob))
    assert "inbox-empty" in page.testids()
    assert "Nothing waits for you" in page.text


def test_the_inbox_groups_and_counts_what_waits(
    bob: Client, waiting: dict[str, Step], agent: Agent
) -> None:
    other, _ = run_create(agent=agent, name="budget run")
    paused(other)
    response = inbox(bob)
    assert tab_counts(response) == {
        "all": 6,
        "unknown": 1,
        "approval": 1,
        "compensation": 1,
        "dead": 1,
        "blocked": 1,
        "paused": 1,
    }
    assert listed(response) == ["u1", "p1", "c1:compensation", "d1", "b1"]
    kinds = re.findall(
        r'data-testid="inbox-row" data-step="[^"]+" data-kind="(\w+)"', response.content.decode()
    )
    assert kinds == ["unknown", "approval", "compensation", "dead", "blocked"]
    page = read(response)
    assert "paused-runs" in page.testids()
    assert "max_calls reached (2 of 2)" in page.text


def test_the_navigation_counts_what_waits(bob: Client, waiting: dict[str, Step]) -> None:
    response = inbox(bob)
    body = response.content.decode()
    assert re.search(r'data-testid="nav-count-total"[^>]*>5<', body)
    for kind in ("unknown", "approval", "compensation", "dead", "blocked"):
        assert re.search(rf'data-testid="nav-count-{kind}">1 ', body)
    region = bob.get(reverse("nav_counts"), **htmx())
    assert region.content.decode().lstrip().startswith('<span id="nav-counts"')
    assert 'data-testid="nav-count-total"' in region.content.decode()


def test_the_state_filter_shows_one_kind(bob: Client, waiting: dict[str, Step]) -> None:
    assert listed(inbox(bob, "?state=dead")) == ["d1"]
    assert listed(inbox(bob, "?state=compensation")) == ["c1:compensation"]


def test_paused_runs_have_their_own_filter(bob: Client, agent: Agent) -> None:
    other, _ = run_create(agent=agent, name="budget run")
    paused(other)
    response = inbox(bob, "?state=paused")
    assert listed(response) == []
    assert "budget run" in read(response).text


def test_the_tool_filter(bob: Client, waiting: dict[str, Step], agent: Agent, run: Run) -> None:
    unknown(agent, run, key="looked", tool="console.lookup")
    assert listed(inbox(bob, "?tool=console.lookup")) == ["looked"]


def test_the_age_filter_keeps_what_waited_longer(bob: Client, waiting: dict[str, Step]) -> None:
    age(waiting["dead"], timedelta(hours=3))
    age(waiting["blocked"], timedelta(days=2))
    assert listed(inbox(bob, "?age=1h")) == ["b1", "d1"]
    assert listed(inbox(bob, "?age=1d")) == ["b1"]


def test_waiting_since_is_when_the_step_began_to_wait_not_its_last_lookup(
    bob: Client, agent: Agent, run: Run
) -> None:
    first = unknown(agent, run, key="first", tool="console.lookup")
    second = unknown(agent, run, key="second", tool="console.lookup")
    age(first, timedelta(hours=2))
    age(second, timedelta(hours=1))
    began = reload(first).state_since
    # The executor looks the first one up again: it cannot tell, so it stays unknown.
    assert recovery.reconcile(first.pk) == State.UNKNOWN
    looked = reload(first)
    assert looked.version == first.version + 1
    assert looked.updated_at > reload(second).updated_at
    assert looked.state_since == began
    # Still the longest waiting, and "2 h ago" on the page.
    response = inbox(bob)
    assert listed(response) == ["first", "second"]
    assert ">2 h ago</time>" in response.content.decode()
    assert listed(inbox(bob, "?age=1h")) == ["first", "second"]


def test_the_workspace_filter_and_a_reviewer_of_two_workspaces(
    alice: Client, waiting: dict[str, Step], other_agent_auth: Any, other_workspace: Any
) -> None:
    tools_sync()
    other_run, _ = run_create(agent=other_agent_auth.agent, name="globex run")
    dead(other_agent_auth.agent, other_run, key="globex-dead", tool="echo")
    assert "globex-dead" in listed(inbox(alice))
    assert listed(inbox(alice, f"?workspace={other_workspace.pk}")) == ["globex-dead"]


def test_a_reviewer_sees_only_their_workspaces(
    bob: Client, charlie: Client, waiting: dict[str, Step], other_agent_auth: Any
) -> None:
    other_run, _ = run_create(agent=other_agent_auth.agent, name="globex run")
    dead(other_agent_auth.agent, other_run, key="globex-dead", tool="echo")
    assert "globex-dead" not in listed(inbox(bob))
    assert listed(inbox(charlie)) == ["globex-dead"]
    # Filtering on a workspace one may not see shows nothing of it.
    assert "globex-dead" not in listed(inbox(bob, f"?workspace={other_run.workspace_id}"))


def test_invalid_filters_are_ignored_not_failed(bob: Client, waiting: dict[str, Step]) -> None:
    response = inbox(bob, "?state=bogus&age=forever&workspace=x&after=not-a-cursor&size=-3")
    assert listed(response) == ["u1"]  # size capped at 1, the filters dropped


def test_keyset_pages_cover_every_step_once(bob: Client, run: Run) -> None:
    bulk_steps(run, 7)
    seen: list[str] = []
    query = "?size=3"
    pages = 0
    while True:
        response = inbox(bob, query)
        seen += listed(response)
        pages += 1
        found = re.search(r'data-testid="next-page"', response.content.decode())
        if not found:
            break
        href = re.search(r'<a href="([^"]+)" rel="next"', response.content.decode()).group(1)
        query = "?" + urlsplit(href.replace("&amp;", "&")).query
    assert pages == 3
    assert sorted(seen) == sorted(f"bulk-{n}" for n in range(1, 8))
    assert len(seen) == len(set(seen))


def test_the_page_size_is_capped(bob: Client, run: Run) -> None:
    bulk_steps(run, 105)
    assert len(listed(inbox(bob, "?size=1000"))) == 100


def test_the_cursor_keeps_the_place_when_new_steps_arrive(
    bob: Client, agent: Agent, run: Run
) -> None:
    bulk_steps(run, 4)
    first = inbox(bob, "?size=2")
    href = re.search(r'<a href="([^"]+)" rel="next"', first.content.decode()).group(1)
    dead(agent, run, key="newcomer")
    second = inbox(bob, "?" + urlsplit(href.replace("&amp;", "&")).query)
    # Longest waiting first: the newcomer goes to the end, not onto the page being read.
    assert listed(first) == ["bulk-1", "bulk-2"]
    assert listed(second) == ["bulk-3", "bulk-4"]
    assert listed(inbox(bob))[-1] == "newcomer"


def test_the_list_region_polls_itself_with_its_filters_and_cursor(bob: Client, run: Run) -> None:
    bulk_steps(run, 4)
    query = f"?size=2&state=unknown&after={'x' * 8}"
    response = inbox(bob, query, **htmx(target="inbox-list"))
    body = response.content.decode()
    assert "<html" not in body
    assert body.lstrip().startswith('<section id="inbox-list"')
    assert 'data-testid="inbox-filters"' not in body
    region = re.search(r'<section id="inbox-list"[^>]*>', body).group(0)
    assert 'hx-trigger="every 5s"' in region
    poll = re.search(r'hx-get="([^"]+)"', region).group(1).replace("&amp;", "&")
    assert parse_qs(urlsplit(poll).query) == {
        "size": ["2"],
        "state": ["unknown"],
        "after": ["x" * 8],
    }


def test_a_tab_redraws_the_filters_with_the_list(bob: Client, waiting: dict[str, Step]) -> None:
    response = inbox(bob, "?state=dead", **htmx(target="inbox"))
    body = response.content.decode()
    assert body.lstrip().startswith('<div id="inbox"')
    assert 'data-testid="inbox-filters"' in body
    assert '<input type="hidden" name="state" value="dead">' in body


def test_every_htmx_link_also_works_without_javascript(
    bob: Client, waiting: dict[str, Step], run: Run
) -> None:
    bulk_steps(run, 30)
    page = read(inbox(bob, "?size=10"))
    links = [attrs for tag, attrs in page.elements if tag == "a" and "hx-get" in attrs]
    assert links
    for attrs in links:
        assert attrs["href"] == attrs["hx-get"]
    for form in page.forms:
        if "hx-get" in form.attrs:
            assert form.attrs["action"] == form.attrs["hx-get"]
            assert form.attrs["method"] == "get"


def test_the_filter_form_has_labels(bob: Client) -> None:
    page = read(inbox(bob))
    form = page.form("inbox-filters")
    for name in ("workspace", "tool", "age"):
        assert page.label_for(form.field(name)["id"])


# --- bulk replay --------------------------------------------------------------------------------


def pick(*steps: Step) -> list[str]:
    return [f"{step.pk}:{step.version}" for step in steps]


def test_dead_rows_carry_a_checkbox_with_their_version(
    bob: Client, waiting: dict[str, Step]
) -> None:
    page = read(inbox(bob))
    boxes = [a for t, a in page.elements if t == "input" and a.get("name") == "steps"]
    replay = [b for b in boxes if b["form"] == "bulk-replay"]
    assert [b["value"] for b in replay] == pick(waiting["dead"])
    # The others are the approvals', for the bulk approve and reject.
    assert {b["form"] for b in boxes} == {"bulk-replay", "bulk-decide"}
    assert [b["value"] for b in boxes if b["form"] == "bulk-decide"] == pick(
        waiting["approval"], waiting["compensation"]
    )
    assert page.form("bulk-replay-form").buttons == ["Replay selected"]


def test_the_bulk_replay_form_shows_only_with_a_dead_letter_to_replay(
    bob: Client, dave: Client, agent: Agent, run: Run
) -> None:
    planned(agent, run, key="p1")
    assert "bulk-replay-form" not in read(inbox(bob)).testids()
    dead(agent, run, key="d1")
    assert "bulk-replay-form" in read(inbox(bob)).testids()
    assert "bulk-replay-form" not in read(inbox(bob, "?state=approval")).testids()
    # dave may not replay: no form, no checkboxes.
    page = read(inbox(dave))
    assert "bulk-replay-form" not in page.testids()
    assert not [a for t, a in page.elements if t == "input" and a.get("name") == "steps"]


def test_replaying_selected_dead_letters(bob: Client, agent: Agent, run: Run) -> None:
    first, second, third = (dead(agent, run, key=f"d{n}") for n in range(3))
    response = bob.post(
        reverse("deadletters_replay"),
        {"steps": pick(first, second), "reason": "the desk is back", "next": "/?state=dead"},
    )
    assert response.status_code == 302
    assert response["Location"] == "/?state=dead"
    assert [reload(s).state for s in (first, second, third)] == [
        State.PENDING,
        State.PENDING,
        State.DEAD,
    ]
    assert events_by(first, "user:bob")[0].reason == "the desk is back"
    assert "Replayed 2 dead letters." in read(bob.get("/?state=dead")).text


def test_bulk_replay_with_htmx_redraws_the_list_with_the_outcome(
    bob: Client, agent: Agent, run: Run
) -> None:
    fresh, stale = dead(agent, run, key="fresh"), dead(agent, run, key="stale")
    old = pick(stale)
    deadletter_replay(
        step=stale, user=User.objects.get(username="bob"), version=stale.version, reason="first"
    )
    response = bob.post(
        reverse("deadletters_replay"),
        {"steps": [*pick(fresh), *old], "reason": "again"},
        **htmx(target="inbox-list", current_url="/?state=dead"),
    )
    assert response.status_code == 200
    body = response.content.decode()
    assert body.lstrip().startswith('<section id="inbox-list"')
    page = read(response)
    assert "Replayed 1 dead letter." in page.text
    assert "stale: Already handled" in page.text
    assert "inbox-changed" in response["HX-Trigger"]
    # The redrawn list keeps the filters of the page the reviewer was on.
    assert "state=dead" in re.search(r'hx-get="([^"]+)"', body).group(1)


def test_bulk_replay_of_only_stale_rows_is_409(bob: Client, agent: Agent, run: Run) -> None:
    step = dead(agent, run)
    old = pick(step)
    deadletter_replay(
        step=step, user=User.objects.get(username="bob"), version=step.version, reason="first"
    )
    with unchanged(step):
        response = bob.post(reverse("deadletters_replay"), {"steps": old, "reason": "again"})
    assert response.status_code == 409
    assert "Nothing replayed" in read(response).text


def test_bulk_replay_needs_a_selection_and_a_reason(bob: Client, agent: Agent, run: Run) -> None:
    step = dead(agent, run)
    with unchanged(step):
        nothing = bob.post(reverse("deadletters_replay"), {"reason": "go"})
        no_reason = bob.post(reverse("deadletters_replay"), {"steps": pick(step), "reason": ""})
    assert nothing.status_code == no_reason.status_code == 422
    assert "Select at least one dead letter." in read(nothing).text
    assert "Give a reason" in read(no_reason).text


def test_bulk_replay_needs_replay_deadletter(dave: Client, agent: Agent, run: Run) -> None:
    step = dead(agent, run)
    with unchanged(step):
        response = dave.post(reverse("deadletters_replay"), {"steps": pick(step), "reason": "go"})
    assert response.status_code == 403
    assert "replay_deadletter" in read(response).text
    assert "bulk-replay-form" not in read(inbox(dave)).testids()


def test_bulk_replay_of_an_outsiders_step_is_404(charlie: Client, agent: Agent, run: Run) -> None:
    step = dead(agent, run)
    with unchanged(step):
        response = charlie.post(
            reverse("deadletters_replay"), {"steps": pick(step), "reason": "go"}
        )
    assert response.status_code == 404


def test_a_malformed_selection_is_a_form_error(bob: Client, agent: Agent, run: Run) -> None:
    step = dead(agent, run)
    with unchanged(step):
        response = bob.post(reverse("deadletters_replay"), {"steps": ["nonsense"], "reason": "go"})
    assert response.status_code == 422
