"""The reads of every agent request, written out once (selectors.agent_by_token_hash,
run_for_agent): the same models the ORM would load, in one statement, nothing lazy left."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.db import connection
from django.db.models import Model
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from executor.ledger import selectors
from executor.ledger.records import Agent, Run, Workspace, hash_token
from executor.services.accounts import agent_create
from executor.services.runs import run_create
from tests.support.api import AgentAuth

pytestmark = pytest.mark.django_db


def field_values(obj: Model) -> dict[str, Any]:
    return {f.attname: getattr(obj, f.attname) for f in obj._meta.concrete_fields}


def test_the_agent_is_loaded_as_the_orm_loads_it_with_its_workspace_and_user(
    agent_auth: AgentAuth,
) -> None:
    Agent.objects.filter(pk=agent_auth.agent.pk).update(last_seen_at=timezone.now())
    expected = Agent.objects.select_related("workspace", "user").get(pk=agent_auth.agent.pk)

    with CaptureQueriesContext(connection) as queries:
        agent = selectors.agent_by_token_hash(hash_token(agent_auth.token))
        assert agent is not None
        workspace, user = agent.workspace, agent.user

    assert len(queries) == 1  # the workspace and the user came with it
    assert field_values(agent) == field_values(expected)
    assert field_values(workspace) == field_values(expected.workspace)
    assert field_values(user) == field_values(expected.user)
    assert agent._state.adding is False
    assert agent._state.db == connection.alias


def test_an_unknown_token_an_inactive_agent_or_an_inactive_user_is_no_agent(
    agent_auth: AgentAuth,
) -> None:
    token_hash = hash_token(agent_auth.token)
    assert selectors.agent_by_token_hash(hash_token("not-a-token")) is None

    Agent.objects.filter(pk=agent_auth.agent.pk).update(is_active=False)
    assert selectors.agent_by_token_hash(token_hash) is None

    Agent.objects.filter(pk=agent_auth.agent.pk).update(is_active=True)
    get_user_model().objects.filter(pk=agent_auth.agent.user_id).update(is_active=False)
    assert selectors.agent_by_token_hash(token_hash) is None


def test_the_run_is_loaded_as_the_orm_loads_it_and_only_in_the_agents_workspace(
    agent: Agent, other_workspace: Workspace
) -> None:
    run, _ = run_create(
        agent=agent, name="reads", max_calls=3, max_cost=Decimal("1.25"), deadline_seconds=60
    )
    stranger, _ = agent_create(workspace=other_workspace, name="stranger")

    loaded = selectors.run_for_agent(agent=agent, run_id=run.pk)

    assert loaded is not None
    assert field_values(loaded) == field_values(Run.objects.get(pk=run.pk))
    assert isinstance(loaded.max_cost, Decimal)
    assert selectors.run_for_agent(agent=stranger, run_id=run.pk) is None
