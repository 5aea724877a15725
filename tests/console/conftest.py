"""Console fixtures: small tools, steps driven into each review state the way the engine
drives them, signed-in clients, and an HTML reader for forms and regions."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.test import Client
from guardian.shortcuts import assign_perm

from executor.contract.tool import (
    register,
    unregister,
)
from executor.ledger.records import (
    Agent,
    Workspace,
)
from executor.ledger.records import Tool as ToolRow
from executor.services.tools import tools_sync
from tests.support.console import TOOLS, signed_in


@pytest.fixture(autouse=True)
def plain_static_files(settings: Any) -> None:
    # The manifest storage of the settings needs `collectstatic`, which a test run skips.
    settings.STORAGES = {
        **settings.STORAGES,
        "staticfiles": {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"},
    }


@pytest.fixture
def tools(agent: Agent) -> Iterator[None]:
    """Registers the console's test tools and lets the agent use them."""
    for cls in TOOLS:
        register(cls)
    try:
        tools_sync()
        for row in ToolRow.objects.filter(name__in=[cls.name for cls in TOOLS]):
            assign_perm("executor.use_tool", agent.user, row)
        yield
    finally:
        for cls in TOOLS:
            unregister(cls.name)


@pytest.fixture
def bob(reviewer: User) -> Client:
    return signed_in(reviewer)


@pytest.fixture
def limited(workspace: Workspace) -> User:
    """dave may look at acme's steps (review_steps) and decide nothing."""
    user = User.objects.create_user("dave", password="dave-pw")
    assign_perm("executor.review_steps", user, workspace)
    return user


@pytest.fixture
def dave(limited: User) -> Client:
    return signed_in(limited)


@pytest.fixture
def charlie(outsider: User) -> Client:
    return signed_in(outsider)


@pytest.fixture
def alice(owner: User) -> Client:
    return signed_in(owner)
