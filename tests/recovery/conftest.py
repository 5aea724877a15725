"""Fixtures of the recovery suites: the ticket desk, Celery workers and a sweeper as real
processes, on the test's own database and on the broker and queue this test process
publishes to (DESIGN.md §2, §7, §13).

The broker is whatever this pytest process was started with (CELERY_BROKER_URL,
CELERY_QUEUE, STEPWARD_BROKER_DIR are read by console/settings.py at startup); the workers
get the same values, so a step posted here is published where they consume. Only the
default queue name is replaced by one of this package's own (`recovery_queue`)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings as django_settings

from executor.drill.config import current_database_url
from executor.drill.processes import DeskProcess
from executor.ledger.records import Agent, Run, Step
from executor.services.posting import step_post
from tests.support.cluster import FAST_EXECUTOR, Cluster, Stall, broker_env, own_queue
from tests.support.processes import (
    Desk,
    start_desk,
)


@pytest.fixture(scope="package")
def recovery_queue() -> Iterator[str]:
    """The queue this process publishes to and this package's workers consume.

    A queue named by CELERY_QUEUE is used as it is. The default one is shared by every
    process on this machine started with defaults (one var/broker folder, one Redis
    list), and a stranger's worker would take our messages and skip them: these tests
    then use a queue of their own, emptied when they end.
    """
    if os.environ.get("CELERY_QUEUE"):
        yield django_settings.CELERY_TASK_DEFAULT_QUEUE
        return
    with own_queue("recovery") as own:
        yield own


@pytest.fixture(autouse=True)
def _no_broker_messages() -> None:
    """Overrides tests/conftest.py: here the messages are the point, workers consume them."""


@pytest.fixture(scope="session")
def desk_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DeskProcess]:
    desk = start_desk(tmp_path_factory.mktemp("recovery-desk"))
    yield desk
    desk.stop()


@pytest.fixture
def desk(desk_process: DeskProcess, settings: Any) -> Iterator[Desk]:
    """The desk with no faults; this process's tools point at it too."""
    settings.TICKETDESK_URL = desk_process.url
    client = Desk(desk_process.url)
    client.faults(reset=True)
    yield client
    client.faults(reset=True)
    client.close()


@pytest.fixture
def cluster(
    recovery_queue: str, transactional_db: Any, desk: Desk, tmp_path: Path
) -> Iterator[Cluster]:
    env = {
        **os.environ,
        **broker_env(),
        **FAST_EXECUTOR,
        "DATABASE_URL": current_database_url(),
        "DJANGO_SETTINGS_MODULE": "console.settings",
        "TICKETDESK_URL": desk.url,
        "EXECUTOR_ALLOW_FAULTS": "1",
        "EXECUTOR_FAULTS": "",
        "EMAIL_BACKEND": "django.core.mail.backends.filebased.EmailBackend",
        "EMAIL_FILE_PATH": str(tmp_path / "mail"),
        "LOG_LEVEL": "INFO",
        "PYTHONUNBUFFERED": "1",
    }
    env.pop("EXECUTOR_FAULTS_SEED", None)
    (tmp_path / "mail").mkdir()
    cluster = Cluster(desk=desk, env=env, tmp=tmp_path)
    yield cluster
    cluster.stop_all()


@pytest.fixture
def post(run: Run, agent: Agent) -> Callable[..., Step]:
    """Posts a step as the agent; its message is published when the post commits."""

    def post_step(tool: str, tool_input: dict[str, Any], *, key: str | None = None) -> Step:
        step, created = step_post(
            agent=agent,
            run=run,
            key=key or f"step-{uuid.uuid4().hex[:12]}",
            tool_name=tool,
            input=tool_input,
        )
        assert created
        return step

    return post_step


@pytest.fixture
def stall(transactional_db: Any) -> Iterator[Stall]:
    stall = Stall()
    yield stall
    stall.remove()
