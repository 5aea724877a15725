"""Browser fixtures: Debian's Chromium driven by Playwright against the live server, signed-in
sessions, a few small tools, and the ticket desk and a Celery worker as real processes on the
test's own database and on a queue of this test process.

Chromium is launched as STACK-NOTES.md says: `/usr/bin/chromium` with the flags below, never
a browser that `playwright install` would download."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings as django_settings
from django.contrib.auth.models import User
from guardian.shortcuts import assign_perm
from playwright.sync_api import Page, expect

from console.celery import app as celery_app
from executor.common import dispatch
from executor.contract.tool import (
    register,
    unregister,
)
from executor.drill.config import current_database_url
from executor.drill.processes import DeskProcess
from executor.ledger.records import (
    Agent,
    Workspace,
)
from executor.ledger.records import Tool as ToolRow
from executor.services.accounts import reviewer_create
from executor.services.tools import tools_sync
from tests.support import processes
from tests.support.browser import (
    CHROMIUM_ARGS,
    EXAMPLE_TOOLS,
    VIEWPORT,
    Desk,
    WorkerProcess,
    sign_in,
)
from tests.support.cluster import own_queue

os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")  # pytest-django live_server + Playwright


# Deadlines only decide when a stuck test gives up, never whether a working one passes. The
# console polls its live regions every 5 s, so an auto-waiting assertion on a region that
# the server changed must be allowed a few of those.
expect.set_options(timeout=20_000)


@pytest.fixture(scope="session")
def browser_type_launch_args(browser_type_launch_args: dict[str, Any]) -> dict[str, Any]:
    return {
        **browser_type_launch_args,
        "executable_path": "/usr/bin/chromium",
        "args": [*browser_type_launch_args.get("args", []), *CHROMIUM_ARGS],
    }


@pytest.fixture(scope="session")
def browser_context_args(browser_context_args: dict[str, Any]) -> dict[str, Any]:
    return {**browser_context_args, "viewport": VIEWPORT, "device_scale_factor": 1}


@pytest.fixture(autouse=True)
def plain_static_files(settings: Any) -> None:
    # The manifest storage of the settings needs `collectstatic`, which a test run skips.
    settings.STORAGES = {
        **settings.STORAGES,
        "staticfiles": {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"},
    }


@pytest.fixture(autouse=True)
def _no_broker_messages(request: pytest.FixtureRequest) -> Iterator[None]:
    """Overrides tests/conftest.py: a test with a real worker publishes for real.

    The others drive the engine in this process and publish nothing, so no message of
    theirs waits on a broker that no worker of theirs reads.
    """
    if "worker" in request.fixturenames:
        yield
        return
    with dispatch.publishing(dispatch.dropping_publisher):
        yield


@pytest.fixture
def bob_page(page: Page, reviewer: User, live_server: Any) -> Page:
    """A browser signed in as bob, who holds every reviewer permission on acme."""
    sign_in(page.context, reviewer, live_server.url)
    return page


@pytest.fixture
def second_reviewer(workspace: Workspace) -> User:
    """erin, a second reviewer with every reviewer permission on acme."""
    return reviewer_create(workspace=workspace, username="erin", password="erin-pw")


@pytest.fixture
def tools(agent: Agent) -> Iterator[None]:
    """Registers the example tools and lets the agent use them."""
    for cls in EXAMPLE_TOOLS:
        register(cls)
    try:
        tools_sync()
        for row in ToolRow.objects.filter(name__in=[cls.name for cls in EXAMPLE_TOOLS]):
            assign_perm("executor.use_tool", agent.user, row)
        yield
    finally:
        for cls in EXAMPLE_TOOLS:
            unregister(cls.name)


@pytest.fixture(scope="session")
def desk_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DeskProcess]:
    desk = processes.start_desk(tmp_path_factory.mktemp("browser-desk"))
    try:
        yield desk
    finally:
        desk.stop()


@pytest.fixture
def desk(desk_process: DeskProcess, settings: Any) -> Iterator[Desk]:
    """The desk with no faults; this process's tools point at it."""
    settings.TICKETDESK_URL = desk_process.url
    client = Desk(desk_process)
    client.faults(reset=True)
    yield client
    client.faults(reset=True)
    client.close()


@pytest.fixture(scope="package")
def browser_queue() -> Iterator[str]:
    """A queue of this test process alone: a stranger's worker on the machine's default
    queue (one var/broker folder, one Redis list) would take our messages and skip them."""
    with own_queue("browser") as own:
        yield own


@pytest.fixture
def worker(
    browser_queue: str, transactional_db: Any, desk: Desk, tmp_path: Path
) -> Iterator[Callable[..., WorkerProcess]]:
    """Starts workers on this test's database, broker and queue; stops them at the end.

    Short leases, so that a crashed worker's step is recoverable within the test. Start a
    worker after publishing what it should take: kombu's filesystem transport can hand a
    polling reader a message file that its writer has created but not yet written, and
    the worker then dies of a JSONDecodeError.
    """
    assert celery_app.conf.broker_url == django_settings.CELERY_BROKER_URL
    assert celery_app.amqp.router.route({}, "stepward.execute_step")["queue"].name == browser_queue
    started: list[WorkerProcess] = []

    def start(**env: str) -> WorkerProcess:
        base_env = {
            **os.environ,
            "CELERY_BROKER_URL": django_settings.CELERY_BROKER_URL,
            "CELERY_QUEUE": browser_queue,
            "STEPWARD_BROKER_DIR": str(django_settings.BROKER_DIR),
            "DATABASE_URL": current_database_url(),
            "DJANGO_SETTINGS_MODULE": "console.settings",
            "TICKETDESK_URL": desk.url,
            "EXECUTOR_LEASE_SECONDS": "2",
            "EXECUTOR_ALLOW_FAULTS": "0",
            "PYTHONUNBUFFERED": "1",
        }
        base_env.pop("EXECUTOR_FAULTS_SEED", None)
        process = WorkerProcess(
            f"browser-{os.getpid()}",
            base_env,
            tmp_path / f"worker-{len(started) + 1}.log",
            browser_queue,
        )
        started.append(process)
        return process.start(faults=env.pop("EXECUTOR_FAULTS", ""), **env)

    yield start
    for process in started:
        process.kill()
