"""Notifications (API.md "Notifications", docs/notifications.md): a record written with the
move that makes an item wait, sent by the sweeper through Apprise as one signed digest per
subscriber and window, retried with backoff, shown in admin, and free for the engine."""

from __future__ import annotations

import email
import email.policy
import hashlib
import hmac
import json
from collections.abc import Iterator
from datetime import timedelta
from io import StringIO
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from aiosmtpd.controller import Controller
from django.apps import apps
from django.contrib.auth.models import User
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.db import connection, transaction
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from guardian.shortcuts import assign_perm, remove_perm

from console.forms import PAUSED_RUNS
from executor import engine, signals
from executor.common import dispatch
from executor.contract.tool import FailureClass, ToolError
from executor.ledger import runs, transitions
from executor.ledger.records import (
    Agent,
    DeliveryStatus,
    Notification,
    NotifyDelivery,
    NotifyKind,
    NotifySubscription,
    Run,
    Step,
    Workspace,
)
from executor.ledger.records import Tool as ToolRow
from executor.ledger.selectors import InboxKind
from executor.ledger.states import State
from executor.notifications import outbox, triggers
from executor.services.reviews import compensation_request, step_reject
from executor.services.runs import run_create
from executor.services.tools import tool_policy_set
from tests.support import tooling
from tests.support.api import ApiClient
from tests.support.tooling import WriteTool, post, post_many, reload
from tests.support.upstreams import free_port
from tests.support.webhook_receiver import Receiver

pytestmark = pytest.mark.django_db

KEY = "a-key-the-receiver-holds"


@pytest.fixture(autouse=True)
def engine_env(agent: Agent, settings: Any) -> Iterator[None]:
    settings.NOTIFY_URLS = []
    settings.NOTIFY_SIGNING_KEY = KEY
    settings.NOTIFY_DIGEST_SECONDS = 60
    settings.STEPWARD_PUBLIC_URL = "https://stepward.example.com"
    with tooling.installed(agent), dispatch.publishing(dispatch.dropping_publisher):
        yield


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[Receiver]:
    running = Receiver(free_port(), tmp_path / "received.jsonl").start()
    yield running
    running.stop()


def subscribe(workspace: Workspace, url: str, **fields: Any) -> NotifySubscription:
    return NotifySubscription.objects.create(
        workspace=workspace, name=fields.pop("name", "the desk"), url=url, **fields
    )


def needing_approval(workspace: Workspace, tool: str = "test.write") -> None:
    tool_policy_set(workspace=workspace, tool=tool, approval="always")


def verified(request: dict[str, Any]) -> dict[str, Any]:
    """The body of a received webhook, once its signature is checked as docs/ says."""
    body = request["body"].encode()
    expected = "sha256=" + hmac.new(KEY.encode(), body, hashlib.sha256).hexdigest()
    assert hmac.compare_digest(request["headers"]["X-Stepward-Signature"], expected)
    return json.loads(body)


def kinds() -> list[str]:
    return list(Notification.objects.order_by("id").values_list("kind", flat=True))


def sweep(at: Any = None) -> outbox.NotifyReport:
    report = outbox.notify_pass(owner="test", now=at)
    assert report is not None
    return report


# --- the record, written with the move ------------------------------------------------------


def test_a_step_posted_for_approval_is_recorded_and_one_that_needs_none_is_not(
    agent: Agent, run: Run, workspace: Workspace
) -> None:
    needing_approval(workspace)
    waiting = post(agent, run, "test.write")
    post(agent, run, "test.pure")

    [notification] = Notification.objects.all()
    assert (notification.kind, notification.step_id) == (NotifyKind.APPROVAL, waiting.pk)
    assert notification.run_id == run.pk
    assert notification.created_at == reload(waiting).state_since


def test_every_way_into_the_inbox_is_recorded_once(agent: Agent, run: Run) -> None:
    WriteTool.will(FailureClass.AMBIGUOUS)
    unknown = post(agent, run, "test.write")
    assert engine.process(unknown.pk, worker="w1") == State.UNKNOWN
    # A lookup that could not tell leaves it unknown: no second notification.
    transitions.move(reload(unknown), State.UNKNOWN, actor="test", reason="still cannot tell")
    runs.pause(run, reason="budget", actor="test")

    assert kinds() == [NotifyKind.UNKNOWN, NotifyKind.PAUSED]
    assert Notification.objects.get(kind=NotifyKind.PAUSED).step_id is None


def test_a_compensation_request_is_recorded_as_one(agent: Agent, run: Run, reviewer: User) -> None:
    done = post(agent, run, "test.undoable")
    assert engine.process(done.pk, worker="w1") == State.COMPLETED
    done = reload(done)

    undo = compensation_request(
        step=done, user=reviewer, version=done.version, reason="wrong customer"
    )

    assert Notification.objects.get().kind == NotifyKind.COMPENSATION
    assert Notification.objects.get().step_id == undo.pk


@pytest.mark.parametrize(
    ("state", "compensating", "kind"),
    [
        (State.DEAD, False, NotifyKind.DEAD),
        (State.BLOCKED, False, NotifyKind.BLOCKED),
        (State.FAILED, True, NotifyKind.FAILED_COMPENSATION),
        (State.FAILED, False, None),
        (State.CANCELLED, False, None),
    ],
)
def test_the_database_records_each_waiting_state_whoever_writes_it(
    agent: Agent, run: Run, state: State, compensating: bool, kind: str | None
) -> None:
    """The triggers see the row, not the code that wrote it: a plain UPDATE counts too."""
    original = post(agent, run, "test.pure")
    step = post(agent, run, "test.pure")
    if compensating:
        Step.objects.filter(pk=step.pk).update(compensates=original)

    Step.objects.filter(pk=step.pk).update(state=state, failure_class="transient")

    assert kinds() == ([kind] if kind else [])


def test_a_move_rolled_back_leaves_no_notification(agent: Agent, run: Run) -> None:
    WriteTool.will(FailureClass.AMBIGUOUS)
    step = post(agent, run, "test.write")
    seen = []

    def process_then_fail() -> None:
        with transaction.atomic():
            engine.process(step.pk, worker="w1")
            seen.extend(kinds())
            raise RuntimeError("the commit never happens")

    with pytest.raises(RuntimeError):
        process_then_fail()

    assert seen == [NotifyKind.UNKNOWN]

    assert kinds() == []


def _without_triggers() -> None:
    triggers.uninstall(connection)
    assert triggers.installed(connection) == set()


def test_migrate_puts_back_triggers_that_went_missing() -> None:
    """As SQLite drops a table's triggers when a migration rebuilds the table (its way of
    altering one), every migrate installs them again."""
    assert triggers.installed(connection) == set(triggers.NAMES)
    triggers.uninstall(connection)
    assert triggers.installed(connection) == set()

    signals.notification_triggers_after_migrate(apps.get_app_config("executor"), using="default")

    assert triggers.installed(connection) == set(triggers.NAMES)


def test_the_engine_spends_no_statement_on_notifications(
    agent: Agent, workspace: Workspace, settings: Any, receiver: Receiver
) -> None:
    """Forty writes whose outcome is lost, drained with subscribers and the triggers, then
    again with neither: the same statements, one for one; only the first wrote records."""

    # Tools defined by rows are looked for every few seconds, whatever else happens: not
    # within this test, so that the two counts are of the same work.
    settings.EXECUTOR_TOOL_REFRESH_SECONDS = 10**6

    def drain(name: str) -> list[str]:
        run, _ = run_create(agent=agent, name=name)
        post_many(agent, run, "test.write", 40)
        WriteTool.will(*[FailureClass.AMBIGUOUS] * 40)
        with CaptureQueriesContext(connection) as queries:
            assert engine.drain(worker="w1") == 40
        assert Step.objects.filter(run=run, state=State.UNKNOWN).count() == 40
        return [q["sql"] for q in queries.captured_queries]

    subscribe(workspace, receiver.url)
    settings.NOTIFY_URLS = [receiver.url]
    with_notifications = drain("with")
    assert Notification.objects.filter(kind=NotifyKind.UNKNOWN).count() == 40

    NotifySubscription.objects.all().delete()
    settings.NOTIFY_URLS = []
    _without_triggers()
    without = drain("without")
    assert Notification.objects.count() == 40  # none more

    assert len(with_notifications) == len(without)
    assert not any("notif" in sql.lower() for sql in with_notifications)


def test_posting_a_hundred_approvals_spends_no_statement_on_notifications(
    api: ApiClient, agent: Agent, workspace: Workspace, settings: Any
) -> None:
    needing_approval(workspace)
    settings.EXECUTOR_TOOL_REFRESH_SECONDS = 10**6  # as above

    def post_batch(name: str) -> int:
        run = api.post("/api/v1/runs", {"name": name}).json()
        steps = [{"key": f"s{i}", "tool": "test.write", "input": {"n": i}} for i in range(100)]
        with CaptureQueriesContext(connection) as queries:
            answer = api.post(f"/api/v1/runs/{run['id']}/steps/batch", {"steps": steps})
        assert answer.status_code == 201
        return len(queries.captured_queries)

    with_triggers = post_batch("with")
    assert Notification.objects.filter(kind=NotifyKind.APPROVAL).count() == 100
    _without_triggers()
    assert post_batch("without") == with_triggers
    assert Notification.objects.count() == 100


# --- one signed digest, with working links ----------------------------------------------------


def test_a_webhook_receiver_gets_one_signed_digest_for_a_hundred_new_approvals(
    api: ApiClient,
    workspace: Workspace,
    reviewer: User,
    outsider: User,
    receiver: Receiver,
) -> None:
    needing_approval(workspace)
    subscribe(workspace, receiver.url)
    run = api.post("/api/v1/runs", {"name": "refunds"}).json()
    steps = [{"key": f"s{i}", "tool": "test.write", "input": {"n": i}} for i in range(100)]
    assert api.post(f"/api/v1/runs/{run['id']}/steps/batch", {"steps": steps}).status_code == 201

    report = sweep()

    assert (report.handed_out, report.sent) == (100, 1)
    [request] = receiver.received()
    assert request["path"] == "/hooks/stepward"
    digest = verified(request)
    assert digest["event"] == "digest"
    assert digest["count"] == 100
    assert digest["workspace"] == workspace.slug
    assert digest["reason"].startswith("100 items wait for a person")
    assert {item["event"] for item in digest["items"]} == {"approval"}
    assert {item["step_id"] for item in digest["items"]} == {
        str(pk) for pk in Step.objects.filter(run_id=run["id"]).values_list("pk", flat=True)
    }
    assert all(item["tool"] == "test.write" for item in digest["items"])

    # Every link is absolute, on the console's public address, and opens for a reviewer.
    desk, other = Client(), Client()
    desk.force_login(reviewer)
    other.force_login(outsider)
    links = [digest["console_url"], *(item["console_url"] for item in digest["items"])]
    for link in links:
        assert link.startswith("https://stepward.example.com/")
        parts = urlsplit(link)
        path = f"{parts.path}?{parts.query}" if parts.query else parts.path
        assert desk.get(path).status_code == 200, link
    inbox = urlsplit(digest["console_url"])
    assert inbox.query == f"workspace={workspace.pk}&state=approval"
    assert desk.get(f"{inbox.path}?{inbox.query}&size=100").content.count(b"/steps/") >= 100
    assert other.get(urlsplit(digest["items"][0]["console_url"]).path).status_code == 404

    # Sent once: the next pass has nothing more to say.
    assert sweep().sent == 0
    assert len(receiver.received()) == 1


def test_a_single_item_is_sent_as_itself_with_the_contracts_fields(
    agent: Agent, run: Run, workspace: Workspace, receiver: Receiver
) -> None:
    needing_approval(workspace)
    subscribe(workspace, receiver.url)
    step = post(agent, run, "test.write")

    sweep()

    [request] = receiver.wait_for(1)
    body = verified(request)
    # The five lines docs/notifications.md gives receivers say the same.
    docs = (Path(__file__).parents[2] / "docs" / "notifications.md").read_text()
    snippet = docs.split("```python\n", 1)[1].split("```", 1)[0]
    namespace: dict[str, Any] = {}
    exec(snippet, namespace)
    signature = request["headers"]["X-Stepward-Signature"]
    assert namespace["verified"](request["body"].encode(), signature, KEY) == body
    with pytest.raises(ValueError, match="bad signature"):
        namespace["verified"](request["body"].encode() + b" ", signature, KEY)
    assert {
        "event",
        "workspace",
        "step_id",
        "run_id",
        "tool",
        "reason",
        "console_url",
        "at",
    } <= set(body)
    assert body["event"] == "approval"
    assert body["step_id"] == str(step.pk)
    assert body["run_id"] == str(run.pk)
    assert body["console_url"] == f"https://stepward.example.com/steps/{step.pk}/"
    assert body["count"] == 1


def test_a_global_url_from_the_settings_hears_of_every_workspace(
    agent: Agent,
    run: Run,
    other_agent_auth: Any,
    workspace: Workspace,
    other_workspace: Workspace,
    settings: Any,
    receiver: Receiver,
) -> None:
    settings.NOTIFY_URLS = [receiver.url]
    needing_approval(workspace)
    needing_approval(other_workspace)
    other_agent = other_agent_auth.agent
    assign_perm("executor.use_tool", other_agent.user, ToolRow.objects.get(name="test.write"))
    other_run, _ = run_create(agent=other_agent, name="other")
    post(agent, run, "test.write")
    post(agent, run, "test.write")
    post(other_agent, other_run, "test.write")

    sweep()

    [request] = receiver.received()
    digest = verified(request)
    assert digest["count"] == 3
    assert digest["workspace"] is None  # two workspaces: the link is the whole inbox
    assert {item["workspace"] for item in digest["items"]} == {"acme", "globex"}
    assert digest["console_url"] == "https://stepward.example.com/?state=approval"


# --- the digest window ---------------------------------------------------------------------


def test_what_arrives_within_the_window_waits_for_one_more_message(
    agent: Agent, run: Run, workspace: Workspace, receiver: Receiver
) -> None:
    needing_approval(workspace)
    subscribe(workspace, receiver.url)
    start = timezone.now()
    post(agent, run, "test.write")
    assert sweep(start).sent == 1

    later = [post(agent, run, "test.write") for _ in range(5)]
    assert sweep(start + timedelta(seconds=30)).sent == 0
    assert sweep(start + timedelta(seconds=59)).sent == 0
    assert len(receiver.received()) == 1

    assert sweep(start + timedelta(seconds=60)).sent == 1
    second = verified(receiver.received()[1])
    assert second["count"] == 5
    assert {item["step_id"] for item in second["items"]} == {str(s.pk) for s in later}


def test_an_item_decided_before_the_sweep_is_nobodys_news(
    agent: Agent, run: Run, workspace: Workspace, reviewer: User, receiver: Receiver
) -> None:
    needing_approval(workspace)
    subscribe(workspace, receiver.url)
    step = post(agent, run, "test.write")
    step_reject(step=step, user=reviewer, reason="no", version=step.version)

    assert sweep().handed_out == 1
    assert receiver.received() == []


# --- who is told --------------------------------------------------------------------------


def test_nobody_is_told_who_did_not_subscribe(
    agent: Agent, run: Run, workspace: Workspace, owner: User
) -> None:
    needing_approval(workspace)
    post(agent, run, "test.write")

    assert sweep().handed_out == 1
    assert NotifyDelivery.objects.count() == 0  # not the superuser either


def test_a_reviewers_subscription_brings_only_what_they_may_decide(
    agent: Agent, run: Run, workspace: Workspace, reviewer: User, receiver: Receiver
) -> None:
    needing_approval(workspace)
    subscribe(workspace, receiver.url, user=reviewer)
    remove_perm("executor.approve_steps", reviewer, workspace)
    post(agent, run, "test.write")
    WriteTool.will(FailureClass.AMBIGUOUS)
    tool_policy_set(workspace=workspace, tool="test.write", approval="never")
    unknown = post(agent, run, "test.write")
    engine.process(unknown.pk, worker="w1")

    sweep()

    [request] = receiver.received()
    assert verified(request)["event"] == "unknown"


def test_a_subscription_can_ask_for_some_kinds_only(
    agent: Agent, run: Run, workspace: Workspace, receiver: Receiver
) -> None:
    subscribe(workspace, receiver.url, kinds=["paused"])
    needing_approval(workspace)
    post(agent, run, "test.write")
    runs.pause(run, reason="out of budget", actor="test")

    sweep()

    [request] = receiver.received()
    body = verified(request)
    assert body["event"] == "paused"
    assert body["console_url"] == f"https://stepward.example.com/runs/{run.pk}/"
    assert "out of budget" in body["reason"]


def test_secrets_in_a_reason_are_redacted(
    agent: Agent, run: Run, workspace: Workspace, receiver: Receiver
) -> None:
    subscribe(workspace, receiver.url)
    secret = "sk_live_51HcZ8QJkq2x9Yp7TmV3nR4wLs"
    WriteTool.will(ToolError(FailureClass.AMBIGUOUS, f"timed out; Authorization: Bearer {secret}"))
    step = post(agent, run, "test.write")
    assert engine.process(step.pk, worker="w1") == State.UNKNOWN

    sweep()

    [request] = receiver.received()
    assert secret not in request["body"]
    assert "[redacted]" in verified(request)["reason"]


# --- retries -------------------------------------------------------------------------------


def test_a_receiver_that_is_down_gets_the_message_later(
    agent: Agent, run: Run, workspace: Workspace, tmp_path: Path, owner: User
) -> None:
    down = Receiver(free_port(), tmp_path / "later.jsonl")
    subscribe(workspace, down.url)
    needing_approval(workspace)
    steps = [post(agent, run, "test.write") for _ in range(3)]
    start = timezone.now()

    assert sweep(start).retried == 1
    delivery = NotifyDelivery.objects.get()
    assert (delivery.status, delivery.attempts) == (DeliveryStatus.PENDING, 1)
    assert delivery.next_attempt_at == start + timedelta(seconds=30)
    assert "127.0.0.1" in delivery.last_error

    # Not before its wait is over, even with the receiver back.
    down.start()
    try:
        assert sweep(start + timedelta(seconds=29)).sent == 0
        assert down.received() == []
        assert sweep(start + timedelta(seconds=30)).sent == 1
        [request] = down.received()
    finally:
        down.stop()
    assert {item["step_id"] for item in verified(request)["items"]} == {str(s.pk) for s in steps}
    delivery.refresh_from_db()
    assert (delivery.status, delivery.attempts, delivery.last_error) == ("sent", 2, "")

    # And admin shows it.
    desk = Client()
    desk.force_login(owner)
    page = desk.get("/admin/executor/notifydelivery/")
    assert page.status_code == 200
    assert b"127.0.0.1" in page.content
    assert b"sent" in page.content


def test_retries_back_off_to_an_hour_and_stop_after_ten_attempts(
    agent: Agent, run: Run, workspace: Workspace
) -> None:
    """The span docs/notifications.md states: attempts 30 s, 1, 2, 4, 8, 16 and 32 min, then
    hourly apart; the tenth, 11,010 s (3 h 3 min 30 s) after the first, is the last."""
    subscribe(workspace, Receiver(free_port(), Path("/nonexistent")).url)
    needing_approval(workspace)
    post(agent, run, "test.write")
    at = first = timezone.now()
    waits = []
    for _ in range(10):
        sweep(at)
        delivery = NotifyDelivery.objects.get()
        if delivery.next_attempt_at is None:
            break
        waits.append((delivery.next_attempt_at - at).total_seconds())
        at = delivery.next_attempt_at

    assert waits == [30, 60, 120, 240, 480, 960, 1920, 3600, 3600]
    assert (at - first).total_seconds() == 11010
    assert (delivery.status, delivery.attempts) == (DeliveryStatus.FAILED, 10)
    assert sweep(at + timedelta(days=1)).sent == 0


def test_a_json_webhook_is_never_sent_unsigned(
    agent: Agent, run: Run, workspace: Workspace, settings: Any, receiver: Receiver
) -> None:
    settings.NOTIFY_SIGNING_KEY = ""
    subscribe(workspace, receiver.url)
    needing_approval(workspace)
    post(agent, run, "test.write")

    sweep()

    assert receiver.received() == []
    assert "NOTIFY_SIGNING_KEY" in NotifyDelivery.objects.get().last_error


def test_manage_py_sweep_sends_them(
    agent: Agent, run: Run, workspace: Workspace, receiver: Receiver
) -> None:
    subscribe(workspace, receiver.url)
    needing_approval(workspace)
    post(agent, run, "test.write")

    call_command("sweep")

    assert len(receiver.received()) == 1


# --- admin ----------------------------------------------------------------------------------


def test_admin_lists_subscriptions_with_their_secrets_masked(
    owner: User, workspace: Workspace
) -> None:
    token = "T1JJ3T3L2/A1BRTD4JD/TIiajkdnlazkcOXrIdevi7FQ"
    subscribe(workspace, f"slack://{token}/#reviews", name="slack")
    desk = Client()
    desk.force_login(owner)

    page = desk.get("/admin/executor/notifysubscription/")

    assert page.status_code == 200
    assert b"slack://" in page.content
    assert b"TIiajkdnlazkcOXrIdevi7FQ" not in page.content


def test_admin_refuses_a_url_apprise_cannot_send_to(owner: User, workspace: Workspace) -> None:
    desk = Client()
    desk.force_login(owner)
    form = {"workspace": workspace.pk, "name": "x", "kinds": "[]", "active": "on"}

    refused = desk.post("/admin/executor/notifysubscription/add/", {**form, "url": "nope://x"})
    assert refused.status_code == 200
    assert b"Apprise cannot send to this nope:// URL" in refused.content

    bad_kinds = {**form, "url": "jsons://h.example/x", "kinds": '["approval", "nope"]'}
    refused = desk.post("/admin/executor/notifysubscription/add/", bad_kinds)
    assert refused.status_code == 200
    assert b"a list of kinds among approval, compensation" in refused.content

    for url in ("mailtos://bob:pw@mail.example.com?to=desk@example.com", "jsons://h.example/x"):
        added = desk.post("/admin/executor/notifysubscription/add/", {**form, "url": url})
        assert added.status_code == 302, added.content
    assert NotifySubscription.objects.count() == 2


def test_admin_shows_the_records(owner: User, agent: Agent, run: Run, workspace: Workspace) -> None:
    needing_approval(workspace)
    step = post(agent, run, "test.write")
    desk = Client()
    desk.force_login(owner)

    page = desk.get("/admin/executor/notification/")

    assert page.status_code == 200
    assert str(step.pk).encode() in page.content
    assert b"approval" in page.content


# --- email, through a real SMTP server --------------------------------------------------------


@pytest.fixture
def mailbox() -> Iterator[tuple[int, list[Any]]]:
    """An SMTP server (aiosmtpd) on a port of its own; what it accepted, as envelopes."""
    received: list[Any] = []

    class Handler:
        async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:
            received.append(envelope)
            return "250 OK"

    port = free_port()
    controller = Controller(Handler(), hostname="127.0.0.1", port=port)
    controller.start()
    yield port, received
    controller.stop()


def test_an_email_subscriber_gets_one_digest_with_the_links(
    agent: Agent, run: Run, workspace: Workspace, mailbox: tuple[int, list[Any]]
) -> None:
    port, received = mailbox
    url = f"mailto://127.0.0.1:{port}?from=stepward@example.com&to=desk@example.com"
    subscribe(workspace, url, name="desk mail")
    needing_approval(workspace)
    steps = [post(agent, run, "test.write") for _ in range(3)]

    assert sweep().sent == 1

    [envelope] = received
    assert envelope.rcpt_tos == ["desk@example.com"]
    mail = email.message_from_bytes(envelope.content, policy=email.policy.default)
    assert mail["Subject"] == "Stepward: 3 items wait for a person in acme"
    text = mail.get_body(preferencelist=("plain",)).get_content()
    for step in steps:
        assert f"https://stepward.example.com/steps/{step.pk}/" in text
    assert f"https://stepward.example.com/?workspace={workspace.pk}&state=approval" in text


# --- what a message says --------------------------------------------------------------------


def test_the_events_are_the_inboxs_filters() -> None:
    """Each event's name is a value of the inbox's `state` filter, so its link filters."""
    assert set(NotifyKind.values) == {*InboxKind.values, PAUSED_RUNS}


def test_a_digest_of_more_than_a_hundred_lists_a_hundred_and_counts_them_all(
    agent: Agent, run: Run, workspace: Workspace, receiver: Receiver
) -> None:
    needing_approval(workspace)
    subscribe(workspace, receiver.url)
    post_many(agent, run, "test.write", 150)
    runs.pause(run, reason="budget", actor="test")

    sweep()

    digest = verified(receiver.received()[0])
    assert digest["count"] == 151
    assert len(digest["items"]) == 100
    assert digest["reason"] == ("151 items wait for a person: 150 awaiting approval, 1 paused run")
    assert digest["tool"] is None  # a paused run among them
    assert digest["console_url"] == f"https://stepward.example.com/?workspace={workspace.pk}"


# --- settings -------------------------------------------------------------------------------


def test_a_bad_notify_url_stops_startup_named_and_masked(settings: Any) -> None:
    settings.NOTIFY_URLS = ["json://h.example/x", "slack://not-a-token"]

    with pytest.raises(SystemCheckError) as refused:
        call_command("check")

    assert "NOTIFY_URLS entry 2 (slack://…): Apprise cannot send to this slack:// URL" in str(
        refused.value
    )
    assert "not-a-token" not in str(refused.value)


def test_a_webhook_without_a_signing_key_is_warned_of(settings: Any) -> None:
    settings.NOTIFY_URLS = ["json://h.example/x"]
    settings.NOTIFY_SIGNING_KEY = ""
    out = StringIO()

    call_command("check", stdout=out, stderr=out)

    assert "NOTIFY_URLS entry 1 is a JSON webhook and NOTIFY_SIGNING_KEY is not set" in (
        out.getvalue()
    )


def test_a_webhooks_password_and_header_values_are_masked() -> None:
    url = "jsons://bot:hunter22@hooks.example.com:8443/in?+Authorization=Bearer%20abc123xyz"

    shown = outbox.masked(url)

    assert shown == "jsons://bot:****@hooks.example.com:8443/in +Authorization=****"


# --- keeping --------------------------------------------------------------------------------


def test_old_messages_and_their_records_are_deleted_pending_ones_kept(
    agent: Agent, run: Run, workspace: Workspace, receiver: Receiver, settings: Any
) -> None:
    settings.NOTIFY_KEEP_DAYS = 30
    needing_approval(workspace)
    subscribe(workspace, receiver.url)
    start = timezone.now()
    post(agent, run, "test.write")
    sweep(start)
    receiver.stop()
    post(agent, run, "test.write")
    sweep(start + timedelta(days=1))  # fails: kept pending
    assert NotifyDelivery.objects.filter(status=DeliveryStatus.PENDING).count() == 1

    report = sweep(start + timedelta(days=31))

    assert report.pruned >= 2  # the sent message, its link and its notification
    [kept] = NotifyDelivery.objects.all()
    assert kept.status == DeliveryStatus.PENDING
    assert Notification.objects.count() == 1
    assert kept.notifications.count() == 1


def test_admin_pages_of_a_message_and_a_subscription_open(
    owner: User, agent: Agent, run: Run, workspace: Workspace, receiver: Receiver
) -> None:
    subscription = subscribe(workspace, receiver.url)
    needing_approval(workspace)
    step = post(agent, run, "test.write")
    sweep()
    desk = Client()
    desk.force_login(owner)

    delivery = NotifyDelivery.objects.get()
    assert desk.get(f"/admin/executor/notifydelivery/{delivery.pk}/change/").status_code == 200
    page = desk.get(f"/admin/executor/notifysubscription/{subscription.pk}/change/")
    assert page.status_code == 200
    listed = desk.get(f"/admin/executor/notification/?deliveries__id__exact={delivery.pk}")
    assert listed.status_code == 200
    assert f"/admin/executor/step/{step.pk}/change/".encode() in listed.content


def test_retry_now_in_admin_sends_a_given_up_message_at_the_next_sweep(
    owner: User, agent: Agent, run: Run, workspace: Workspace, tmp_path: Path, settings: Any
) -> None:
    settings.NOTIFY_MAX_ATTEMPTS = 1
    later = Receiver(free_port(), tmp_path / "later.jsonl")
    subscribe(workspace, later.url)
    needing_approval(workspace)
    post(agent, run, "test.write")
    assert sweep().failed == 1
    delivery = NotifyDelivery.objects.get()
    assert delivery.status == DeliveryStatus.FAILED
    desk = Client()
    desk.force_login(owner)

    answer = desk.post(
        "/admin/executor/notifydelivery/",
        {"action": "retry_now", "_selected_action": [delivery.pk]},
    )

    assert answer.status_code == 302
    delivery.refresh_from_db()
    assert (delivery.status, delivery.attempts) == (DeliveryStatus.PENDING, 0)
    later.start()
    try:
        assert sweep().sent == 1
        assert len(later.received()) == 1
    finally:
        later.stop()
