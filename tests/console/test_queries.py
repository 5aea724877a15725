"""The inbox answers in a fixed number of SQL queries, whatever the page size and the ledger."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.urls import reverse

from executor.ledger.records import Agent, Run, Step
from executor.services.reviews import step_reject
from executor.services.runs import run_create
from executor.services.tools import tools_sync
from tests.support.console import bulk_steps, htmx, paused

# A signed-in reviewer's inbox page, query by query:
#   1 the session, 2 the user, 3-4 the user's global permissions (own and by group; guardian
#   asks once per request and Django keeps them on the user), 5 the workspaces the reviewer
#   may see, 6 the tools for the filter, 7 the counts of every kind, for the navigation and
#   the tabs, in one aggregate, 8 the paused runs' counts, 9 the page of steps with their runs
#   and workspaces, 10 the paused runs listed, 11 the workspaces where the reviewer may replay.
INBOX_QUERIES = 11
# The list region of one kind of step draws no paused runs.
REGION_QUERIES = INBOX_QUERIES - 1


def warm(client: Client) -> None:
    """One request first: guardian caches a permission's content type for the process, so
    the very first request of a process pays two more queries once."""
    assert client.get(reverse("inbox")).status_code == 200


@pytest.fixture
def ledger(agent: Agent, run: Run, other_agent_auth: Any) -> None:
    """Waiting steps in two workspaces, and a paused run, so every query has rows."""
    tools_sync()
    held, _ = run_create(agent=agent, name="held")
    paused(held)
    other_run, _ = run_create(agent=other_agent_auth.agent, name="globex")
    bulk_steps(other_run, 50)


def assert_fixed_count(
    client: Client, django_assert_num_queries: Any, *, expected_rows: int
) -> None:
    for size in (10, 100):
        with django_assert_num_queries(INBOX_QUERIES):
            response = client.get(reverse("inbox"), {"size": size})
        assert response.status_code == 200
        assert response.content.decode().count('data-testid="inbox-row"') == min(
            size, expected_rows
        )
        with django_assert_num_queries(REGION_QUERIES):
            region = client.get(
                reverse("inbox"), {"size": size, "state": "dead"}, **htmx(target="inbox-list")
            )
        assert region.status_code == 200
        assert region.content.decode().count('data-testid="inbox-row"') == size


@pytest.mark.usefixtures("ledger")
def test_the_inbox_query_count_is_fixed_on_two_thousand_steps(
    reviewer: User, run: Run, django_assert_num_queries: Any
) -> None:
    bulk_steps(run, 2000)
    client = Client()
    client.force_login(reviewer)
    warm(client)
    assert_fixed_count(client, django_assert_num_queries, expected_rows=2000)


@pytest.mark.slow
@pytest.mark.usefixtures("ledger")
def test_the_inbox_query_count_is_fixed_on_a_hundred_thousand_steps(
    reviewer: User, run: Run, django_assert_num_queries: Any
) -> None:
    bulk_steps(run, 100_000)
    assert Step.objects.filter(run=run).count() == 100_000
    client = Client()
    client.force_login(reviewer)
    warm(client)
    assert_fixed_count(client, django_assert_num_queries, expected_rows=100_000)


@pytest.mark.usefixtures("ledger")
def test_the_query_count_does_not_grow_with_the_steps_on_a_page(
    reviewer: User, run: Run, django_assert_num_queries: Any
) -> None:
    client = Client()
    client.force_login(reviewer)
    warm(client)
    bulk_steps(run, 3)
    with django_assert_num_queries(INBOX_QUERIES):
        few = client.get(reverse("inbox"), {"size": 100})
    bulk_steps(run, 97)
    with django_assert_num_queries(INBOX_QUERIES):
        many = client.get(reverse("inbox"), {"size": 100})
    assert few.content.decode().count('data-testid="inbox-row"') == 3
    assert many.content.decode().count('data-testid="inbox-row"') == 100


@pytest.mark.usefixtures("ledger")
def test_search_sort_and_claims_cost_no_query_more(
    reviewer: User, run: Run, django_assert_num_queries: Any
) -> None:
    """A claimed row, a search and another sort are read in the same statements: the
    claims come with the page's steps (a join), the search and sort are its conditions."""
    from django.utils import timezone

    from executor.ledger.records import StepClaim

    client = Client()
    client.force_login(reviewer)
    warm(client)
    bulk_steps(run, 60)
    now = timezone.now()
    StepClaim.objects.bulk_create(
        StepClaim(
            step=step, user=reviewer, claimed_at=now, expires_at=now.replace(year=now.year + 1)
        )
        for step in Step.objects.filter(run=run)
    )
    # A search lists no paused runs (they are not steps): one query fewer.
    for query, queries in (
        ({"size": 50}, INBOX_QUERIES),
        ({"size": 50, "sort": "tool"}, INBOX_QUERIES),
        ({"q": "bulk", "sort": "newest"}, INBOX_QUERIES - 1),
    ):
        with django_assert_num_queries(queries):
            response = client.get(reverse("inbox"), query)
        assert response.status_code == 200
        assert response.content.decode().count('data-testid="claimed-by"') >= 10


# The decisions page: 1-4 the session, the user and guardian's global permissions, 5 the
# workspaces, 6 the people for the filter, 7 the tools, 8 the page of events with their steps,
# runs and workspaces, 9 the count, 10-12 the navigation's counts (workspaces, steps, runs).
DECISIONS_QUERIES = 12


@pytest.mark.usefixtures("tools")
def test_the_decisions_page_query_count_is_fixed(
    reviewer: User, agent: Agent, run: Run, django_assert_num_queries: Any
) -> None:
    from tests.support.console import planned

    client = Client()
    client.force_login(reviewer)
    assert client.get(reverse("decisions")).status_code == 200
    made = 0

    def reject(count: int) -> None:
        nonlocal made
        for _ in range(count):
            made += 1
            step = planned(agent, run, key=f"r-{made}")
            step_reject(step=step, user=reviewer, version=step.version, reason="no")

    reject(3)
    with django_assert_num_queries(DECISIONS_QUERIES):
        few = client.get(reverse("decisions"))
    reject(30)
    with django_assert_num_queries(DECISIONS_QUERIES):
        many = client.get(reverse("decisions"))
    assert few.content.decode().count('data-testid="decision-row"') == 3
    assert many.content.decode().count('data-testid="decision-row"') == 33
