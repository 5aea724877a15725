"""Shared fixtures: a workspace with an agent, an owner, a reviewer and an outsider."""

from __future__ import annotations

import os
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.core.cache import caches
from django.core.cache.backends.locmem import LocMemCache

from executor.common import dispatch
from executor.gateway.connections import gateway
from executor.ledger.records import Agent, Workspace
from executor.services.accounts import agent_create, reviewer_create, workspace_get_or_create
from executor.services.runs import run_create
from tests.support.api import AgentAuth, ApiClient
from tests.support.upstreams import GitRepo, Upstream, git_repo, upstream

os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")  # live_server + Playwright


# Suites of real processes, browsers and servers: `make test` runs them once, on PostgreSQL,
# when PostgreSQL answers (.ci/test-suites), and on SQLite only where there is none. What
# tests the embedded setup itself (SQLite and the embedded broker) is `embedded` and runs on
# SQLite always.
HEAVY = (
    "tests/recovery/",
    "tests/browser/",
    "tests/executor/test_event_loop_serving.py",
    "tests/executor/test_web_server.py",
    "tests/executor/test_gateway.py",
    "tests/executor/test_drill.py",
    # A real OpenID Connect provider in a process of its own.
    "tests/console/test_company_sign_in.py",
)
EMBEDDED = (
    "tests/recovery/test_up.py",
    "tests/recovery/test_operator_commands.py",
    "tests/recovery/test_messages.py",
    "tests/recovery/test_crash_points.py",
    "tests/executor/test_event_loop_serving.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks the heavy and embedded suites, and puts the browser tests last. Playwright's
    sync API keeps an asyncio loop running in the main thread from its first test to the
    session's end, and any later async_to_sync there (Django's test client calling an async
    view, such as `step_get`) fails with "You cannot use AsyncToSync in the same thread as an
    async event loop"."""
    root = config.rootpath
    for item in items:
        where = item.path.relative_to(root).as_posix()
        if where.startswith(HEAVY):
            item.add_marker(pytest.mark.heavy)
        if where.startswith(EMBEDDED):
            item.add_marker(pytest.mark.embedded)
    items.sort(key=lambda item: item.get_closest_marker("browser") is not None)


@pytest.fixture
def workspace(db: Any) -> Workspace:
    return workspace_get_or_create(slug="acme", name="Acme")


@pytest.fixture
def other_workspace(db: Any) -> Workspace:
    return workspace_get_or_create(slug="globex", name="Globex")


@pytest.fixture
def agent_auth(workspace: Workspace) -> AgentAuth:
    agent, token = agent_create(workspace=workspace, name="alice-bot")
    return AgentAuth(agent, token)


@pytest.fixture
def agent(agent_auth: AgentAuth) -> Agent:
    return agent_auth.agent


@pytest.fixture
def other_agent_auth(other_workspace: Workspace) -> AgentAuth:
    agent, token = agent_create(workspace=other_workspace, name="mallory-bot")
    return AgentAuth(agent, token)


@pytest.fixture
def api(agent_auth: AgentAuth) -> ApiClient:
    return ApiClient(agent_auth)


@pytest.fixture
def other_api(other_agent_auth: AgentAuth) -> ApiClient:
    return ApiClient(other_agent_auth)


@pytest.fixture
def anonymous_api(db: Any) -> ApiClient:
    return ApiClient(None)


@pytest.fixture
def owner(db: Any) -> Any:
    return get_user_model().objects.create_superuser("alice", "alice@example.com", "alice-pw")


@pytest.fixture
def reviewer(workspace: Workspace) -> Any:
    return reviewer_create(workspace=workspace, username="bob", password="bob-pw")


@pytest.fixture
def outsider(other_workspace: Workspace) -> Any:
    return reviewer_create(workspace=other_workspace, username="charlie", password="charlie-pw")


@pytest.fixture
def run(agent: Agent) -> Any:
    run, _ = run_create(agent=agent, name="test run")
    return run


@pytest.fixture(autouse=True)
def _fresh_limits() -> None:
    """Each test starts with no request counted: the API's limits (per agent, per address,
    long-polls held) live in the cache, and every test's client comes from one address.
    Only the in-process cache is cleared: a shared Redis is not this test's to flush."""
    if isinstance(caches["default"], LocMemCache):
        caches["default"].clear()


@pytest.fixture(autouse=True)
def _calls_in_the_test_thread(settings: Any) -> None:
    """In-process tests make their steps' calls in their own thread, one at a time, in the
    order claimed, as most of them script their tools' answers in that order. Tests of calls
    in flight, and real workers (recovery suites), set EXECUTOR_MAX_IN_FLIGHT themselves."""
    settings.EXECUTOR_MAX_IN_FLIGHT = 0


@pytest.fixture(autouse=True)
def _no_broker_messages(request: pytest.FixtureRequest) -> Any:
    """Unit tests publish nothing: a message is only a hint, and no worker listens here.

    The recovery suites, which run real workers on a real broker, override this fixture.
    """

    with dispatch.publishing(dispatch.dropping_publisher):
        yield


# --- real MCP upstreams (tests/support/upstreams.py) -----------------------------------------


@pytest.fixture
def up(tmp_path: Any) -> Upstream:
    """A real upstream's launcher, which a test can make down or hang, and kill."""
    return upstream(tmp_path)


@pytest.fixture
def repo(tmp_path: Any, up: Upstream) -> GitRepo:
    """A repository where every git_commit is one commit (see tests/support/upstreams.py)."""
    return git_repo(tmp_path, up.state)


@pytest.fixture
def fresh_sessions(settings: Any, tmp_path: Any) -> Any:
    """This process's upstream sessions started anew for the test and ended after it
    (they are per process, the live server's threads included); their stderr logs go to
    the test's own folder."""
    settings.EXECUTOR_UPSTREAM_START_SECONDS = 15
    settings.VAR_DIR = tmp_path / "var"
    gateway().close()
    yield
    gateway().close()
