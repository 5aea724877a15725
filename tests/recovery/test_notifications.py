"""Notifications with real processes (docs/notifications.md): the sweeper as its own process
(`manage.py sweep --loop`) sends the digest of a hundred approvals to a webhook receiver that
is down at first and started later, and the digest arrives once, signed."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from executor.drill.config import current_database_url
from executor.ledger.records import (
    Agent,
    DeliveryStatus,
    NotifyDelivery,
    NotifySubscription,
    Workspace,
)
from executor.services.tools import tool_policy_set
from tests.support import tooling
from tests.support.api import ApiClient
from tests.support.processes import Sweeper, wait_until
from tests.support.upstreams import free_port
from tests.support.webhook_receiver import Receiver

pytestmark = pytest.mark.django_db(transaction=True)

KEY = "the-receivers-key"


@pytest.fixture
def sweeper_env(tmp_path: Path) -> dict[str, str]:
    return {
        **os.environ,
        "DATABASE_URL": current_database_url(),
        "DJANGO_SETTINGS_MODULE": "console.settings",
        "EXECUTOR_SWEEP_SECONDS": "0.2",
        "NOTIFY_SIGNING_KEY": KEY,
        "NOTIFY_RETRY_SECONDS": "1",
        "STEPWARD_PUBLIC_URL": "https://stepward.example.com",
        "STEPWARD_VAR_DIR": str(tmp_path),
        "PYTHONUNBUFFERED": "1",
    }


@pytest.fixture
def installed(agent: Agent) -> Iterator[None]:
    with tooling.installed(agent):
        yield


def test_a_sweeper_process_delivers_the_digest_once_the_receiver_is_up(
    installed: None,
    api: ApiClient,
    workspace: Workspace,
    sweeper_env: dict[str, str],
    tmp_path: Path,
) -> None:
    tool_policy_set(workspace=workspace, tool="test.write", approval="always")
    receiver = Receiver(free_port(), tmp_path / "received.jsonl")
    NotifySubscription.objects.create(workspace=workspace, name="hook", url=receiver.url)
    run = api.post("/api/v1/runs", {"name": "refunds"}).json()
    steps = [{"key": f"s{i}", "tool": "test.write", "input": {"n": i}} for i in range(100)]
    assert api.post(f"/api/v1/runs/{run['id']}/steps/batch", {"steps": steps}).status_code == 201

    sweeper = Sweeper(sweeper_env, tmp_path / "sweeper.log").start()
    try:

        def failed_once() -> Any:
            return NotifyDelivery.objects.filter(attempts__gte=1).first()

        delivery = wait_until(failed_once, seconds=60, what="a first attempt", diagnose=sweeper.log)
        assert delivery.status == DeliveryStatus.PENDING
        assert delivery.last_error
        receiver.start()
        try:
            wait_until(
                lambda: NotifyDelivery.objects.filter(status=DeliveryStatus.SENT).exists(),
                seconds=60,
                what="the digest sent",
                diagnose=sweeper.log,
            )
            received = receiver.received()
        finally:
            receiver.stop()
    finally:
        sweeper.kill()

    [request] = received
    body = request["body"].encode()
    expected = "sha256=" + hmac.new(KEY.encode(), body, hashlib.sha256).hexdigest()
    assert request["headers"]["X-Stepward-Signature"] == expected
    digest = json.loads(body)
    assert (digest["event"], digest["count"], len(digest["items"])) == ("digest", 100, 100)
    sent = NotifyDelivery.objects.get()
    assert sent.attempts >= 2
    assert sent.notifications.count() == 100
