"""Notifications (API.md "Notifications"; docs/notifications.md): telling people that an
item waits for them, without the engine ever waiting on it.

The database writes a `Notification` in the statement that moves a step into a waiting
state or pauses a run (triggers of migration 0014). From there everything is the
sweeper's, here: `fan_out` gathers the new ones into one pending `NotifyDelivery` per
subscriber (a digest: at most one message per subscriber per NOTIFY_DIGEST_SECONDS), and
`send_due` sends the deliveries that are due through Apprise, retrying with backoff.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import urlencode

from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import IntegrityError, transaction
from django.db.models import Count, Max, OuterRef, Q, Subquery
from django.urls import reverse
from django.utils import timezone

from executor.common.redaction import redact_text
from executor.ledger.records import (
    DeliveryStatus,
    Notification,
    NotifyDelivery,
    NotifyKind,
    NotifySubscription,
    Run,
    RunStatus,
    Step,
    SweeperLease,
    Workspace,
)
from executor.ledger.states import State

logger = logging.getLogger(__name__)

LEASE_NAME = "notify"
# New notifications handed out, and deliveries sent, per pass (the next pass goes on).
BATCH = 1000
FAN_OUT_BATCHES = 20
SEND_BATCH = 100
# A pass stops starting new sends after this long (slow subscribers): the next pass goes on.
SEND_SECONDS = 60.0
# A message lists this many items; the rest are counted and reached through the inbox link.
MAX_LISTED = 100
TEXT_LISTED = 20
REASON_LENGTH = 300

# What a reviewer subscribed by name must hold to be told of a kind (DESIGN.md §9).
PERMISSION_FOR: dict[str, str] = {
    NotifyKind.APPROVAL: "approve_steps",
    NotifyKind.COMPENSATION: "approve_compensation",
    NotifyKind.UNKNOWN: "review_steps",
    NotifyKind.DEAD: "replay_deadletter",
    NotifyKind.BLOCKED: "review_steps",
    NotifyKind.FAILED_COMPENSATION: "review_steps",
    NotifyKind.PAUSED: "extend_budget",
}


# --- subscribers ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Subscriber:
    key: str
    url: str
    kinds: frozenset[str] = frozenset()  # empty: every kind
    workspace_id: int | None = None  # None: every workspace (NOTIFY_URLS)
    subscription_id: int | None = None
    user_id: int | None = None

    def wants(self, kind: str) -> bool:
        return not self.kinds or kind in self.kinds


def setting_key(url: str) -> str:
    return "setting:" + hashlib.sha256(url.encode()).hexdigest()[:32]


def setting_subscribers() -> list[Subscriber]:
    return [Subscriber(key=setting_key(url), url=url) for url in settings.NOTIFY_URLS]


def subscription_subscriber(subscription: NotifySubscription) -> Subscriber:
    return Subscriber(
        key=f"subscription:{subscription.pk}",
        url=subscription.url,
        kinds=frozenset(subscription.kinds or ()),
        workspace_id=subscription.workspace_id,
        subscription_id=subscription.pk,
        user_id=subscription.user_id,
    )


def subscribers_of(workspace_ids: Iterable[int]) -> dict[int, list[Subscriber]]:
    """Each workspace's subscribers: its active subscriptions, then NOTIFY_URLS."""
    ids = set(workspace_ids)
    found: dict[int, list[Subscriber]] = {pk: [] for pk in ids}
    for subscription in NotifySubscription.objects.filter(workspace_id__in=ids, active=True):
        found[subscription.workspace_id].append(subscription_subscriber(subscription))
    for subscriber in setting_subscribers():
        for pk in ids:
            found[pk].append(subscriber)
    return found


class Permissions:
    """Whether a subscribed reviewer may act on a kind in a workspace, asked once per pass."""

    def __init__(self) -> None:
        self._users: dict[int, Any] = {}
        self._answers: dict[tuple[int, int, str], bool] = {}
        self._workspaces: dict[int, Workspace] = {}

    def allows(self, user_id: int, workspace_id: int, kind: str) -> bool:
        permission = PERMISSION_FOR[kind]
        asked = (user_id, workspace_id, permission)
        if asked not in self._answers:
            if user_id not in self._users:
                self._users[user_id] = get_user_model().objects.filter(pk=user_id).first()
            user = self._users[user_id]
            if workspace_id not in self._workspaces:
                self._workspaces[workspace_id] = Workspace.objects.get(pk=workspace_id)
            self._answers[asked] = bool(
                user is not None
                and user.is_active
                and user.has_perm(f"executor.{permission}", self._workspaces[workspace_id])
            )
        return self._answers[asked]


# --- fan-out: new notifications into each subscriber's pending delivery --------------------


def still_waiting(kind: str, run: Run, step: tuple[str, str | None] | None) -> bool:
    """Whether the item is still where its notification found it (a step approved, or a run
    resumed, before the sweeper came round is nobody's news). `step` is (state, the state
    of the step it compensates)."""
    if kind == NotifyKind.PAUSED:
        return run.status == RunStatus.PAUSED
    if step is None:
        return False
    state, compensated = step
    if kind in (NotifyKind.APPROVAL, NotifyKind.COMPENSATION):
        return state == State.PLANNED
    if kind == NotifyKind.FAILED_COMPENSATION:
        return state == State.FAILED and compensated == State.COMPLETED
    return state == kind


def fan_out(*, now: datetime) -> int:
    """Hands up to BATCH new notifications to their subscribers' pending deliveries; returns
    how many were handed out (to nobody, too, when nobody subscribes)."""
    digest = timedelta(seconds=settings.NOTIFY_DIGEST_SECONDS)
    with transaction.atomic():
        new = list(
            Notification.objects.filter(fanned_out_at__isnull=True)
            .select_for_update(skip_locked=True)
            .order_by("id")[:BATCH]
        )
        if not new:
            return 0
        runs = Run.objects.in_bulk({n.run_id for n in new})
        compensated = Step.objects.filter(pk=OuterRef("compensates_id")).values("state")[:1]
        steps = {
            pk: (state, compensated_state)
            for pk, state, compensated_state in Step.objects.filter(
                pk__in={n.step_id for n in new if n.step_id}
            )
            .annotate(compensated_state=Subquery(compensated))
            .values_list("pk", "state", "compensated_state")
        }
        subscribers = subscribers_of({run.workspace_id for run in runs.values()})
        permissions = Permissions()
        gathered: dict[str, list[Notification]] = {}
        by_key: dict[str, Subscriber] = {}
        for notification in new:
            run = runs.get(notification.run_id)
            waiting = run is not None and still_waiting(
                notification.kind,
                run,
                steps.get(notification.step_id) if notification.step_id else None,
            )
            if run is None or not waiting:
                continue
            for subscriber in subscribers[run.workspace_id]:
                if not subscriber.wants(notification.kind):
                    continue
                if subscriber.user_id is not None and not permissions.allows(
                    subscriber.user_id, run.workspace_id, notification.kind
                ):
                    continue
                gathered.setdefault(subscriber.key, []).append(notification)
                by_key[subscriber.key] = subscriber
        if gathered:
            deliveries = _pending_deliveries(by_key, now=now, digest=digest)
            through = NotifyDelivery.notifications.through
            through.objects.bulk_create(
                [
                    through(notifydelivery_id=deliveries[key].pk, notification_id=n.pk)
                    for key, notifications in gathered.items()
                    for n in notifications
                ],
                ignore_conflicts=True,
            )
        Notification.objects.filter(pk__in=[n.pk for n in new]).update(fanned_out_at=now)
    return len(new)


def _pending_deliveries(
    subscribers: dict[str, Subscriber], *, now: datetime, digest: timedelta
) -> dict[str, NotifyDelivery]:
    """Each subscriber's pending delivery, made where there is none: due at once, or a digest
    window after the subscriber's last message."""
    keys = list(subscribers)
    found = {
        d.subscriber: d
        for d in NotifyDelivery.objects.filter(subscriber__in=keys, status=DeliveryStatus.PENDING)
    }
    missing = [key for key in keys if key not in found]
    if missing:
        last_sent = dict(
            NotifyDelivery.objects.filter(subscriber__in=missing, sent_at__isnull=False)
            .values("subscriber")
            .annotate(last=Max("sent_at"))
            .values_list("subscriber", "last")
        )
        made = [
            NotifyDelivery(
                subscriber=key,
                subscription_id=subscribers[key].subscription_id,
                target=masked(subscribers[key].url),
                send_after=max(now, last_sent[key] + digest) if key in last_sent else now,
                created_at=now,
            )
            for key in missing
        ]
        NotifyDelivery.objects.bulk_create(made)
        if not all(d.pk for d in made):  # backends that return no ids on bulk inserts
            made = list(
                NotifyDelivery.objects.filter(subscriber__in=missing, status=DeliveryStatus.PENDING)
            )
        found.update({d.subscriber: d for d in made})
    return found


# --- messages ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Item:
    event: str
    workspace: str
    workspace_id: int
    step_id: str | None
    run_id: str
    tool: str | None
    reason: str
    console_url: str
    at: str

    def as_json(self) -> dict[str, Any]:
        return {
            "event": self.event,
            "workspace": self.workspace,
            "step_id": self.step_id,
            "run_id": self.run_id,
            "tool": self.tool,
            "reason": self.reason,
            "console_url": self.console_url,
            "at": self.at,
        }


@dataclass
class Message:
    title: str
    text: str
    payload: dict[str, Any] = field(default_factory=dict)

    def body_json(self) -> str:
        return json.dumps(self.payload, ensure_ascii=False, separators=(",", ":"))


def absolute(path: str) -> str:
    return settings.STEPWARD_PUBLIC_URL.rstrip("/") + path


def inbox_url(*, workspace_id: int | None, kind: str | None) -> str:
    """The console's inbox, filtered to the workspace and kind where the items share them."""
    query = {}
    if workspace_id is not None:
        query["workspace"] = str(workspace_id)
    if kind is not None:
        query["state"] = kind
    return absolute(reverse("inbox") + (f"?{urlencode(query)}" if query else ""))


def _shown(text: str) -> str:
    """Free text as a message may carry it: secrets redacted (DESIGN.md §15), cut short."""
    text = redact_text(" ".join(text.split()))
    return text if len(text) <= REASON_LENGTH else text[: REASON_LENGTH - 1] + "…"


def reason_of(notification: Notification, run: Run, step: Step | None) -> str:
    kind = notification.kind
    if kind == NotifyKind.PAUSED:
        return _shown(f"run {run.name!r} paused: {run.pause_reason}")
    assert step is not None
    failure = f"{step.failure_class}: {step.failure_message}".strip(": ")
    text = {
        NotifyKind.APPROVAL: f"awaits approval: {step.input_summary}",
        NotifyKind.COMPENSATION: f"compensation awaits approval: {step.input_summary}",
        NotifyKind.UNKNOWN: f"outcome unknown: {failure}",
        NotifyKind.DEAD: f"dead letter: {failure}",
        NotifyKind.BLOCKED: f"blocked: {failure}",
        NotifyKind.FAILED_COMPENSATION: f"compensation failed: {failure}",
    }[NotifyKind(kind)]
    return _shown(text.rstrip(": "))


@dataclass(frozen=True)
class Held:
    """What a delivery holds, over all its items (the message lists only the first)."""

    total: int
    per_kind: dict[str, int]
    workspaces: dict[int, str]  # id → slug
    tools: frozenset[str | None]  # None: a paused run's


def items_of(delivery: NotifyDelivery) -> tuple[list[Item], Held]:
    """The delivery's first MAX_LISTED items (oldest first), and what it holds in all."""
    notifications = delivery.notifications.order_by("id")
    per_kind = dict(
        notifications.order_by().values("kind").annotate(n=Count("pk")).values_list("kind", "n")
    )
    workspaces = dict(
        Workspace.objects.filter(
            pk__in=Run.objects.filter(pk__in=notifications.order_by().values("run_id")).values(
                "workspace_id"
            )
        ).values_list("pk", "slug")
    )
    tools: set[str | None] = {
        str(name)
        for name in Step.objects.filter(pk__in=notifications.order_by().values("step_id"))
        .values_list("tool_id", flat=True)
        .distinct()
    }
    if NotifyKind.PAUSED in per_kind:
        tools.add(None)
    listed = list(notifications[:MAX_LISTED])
    runs = Run.objects.select_related("workspace").in_bulk({n.run_id for n in listed})
    steps = Step.objects.in_bulk({n.step_id for n in listed if n.step_id})
    items = []
    for n in listed:
        run = runs.get(n.run_id)
        step = steps.get(n.step_id) if n.step_id else None
        if run is None or (n.step_id and step is None):
            per_kind[n.kind] -= 1  # archived meanwhile: nothing left to link to
            continue
        page = reverse("step", args=[step.pk]) if step else reverse("run", args=[run.pk])
        items.append(
            Item(
                event=n.kind,
                workspace=run.workspace.slug,
                workspace_id=run.workspace_id,
                step_id=str(step.pk) if step else None,
                run_id=str(run.pk),
                tool=step.tool_id if step else None,
                reason=reason_of(n, run, step),
                console_url=absolute(page),
                at=n.created_at.isoformat(),
            )
        )
    per_kind = {kind: n for kind, n in per_kind.items() if n > 0}
    return items, Held(sum(per_kind.values()), per_kind, workspaces, frozenset(tools))


def compose(items: Sequence[Item], held: Held, *, now: datetime) -> Message:
    """One message for the items: the item itself when alone, else a digest whose link is
    the inbox filtered to what all the items share."""
    listed = [item.as_json() for item in items]
    total = held.total
    if total == 1 and len(items) == 1:
        (item,) = items
        title = f"Stepward: {NotifyKind(item.event).label.lower()} in {item.workspace}"
        text = f"{item.tool or 'run'}: {item.reason}\n{item.console_url}"
        return Message(title, text, {**item.as_json(), "count": 1, "items": listed})
    workspace_id = next(iter(held.workspaces)) if len(held.workspaces) == 1 else None
    kind = next(iter(held.per_kind)) if len(held.per_kind) == 1 else None
    link = inbox_url(workspace_id=workspace_id, kind=kind)
    counted = ", ".join(
        f"{n} {NotifyKind(k).label.lower()}" for k, n in sorted(held.per_kind.items())
    )
    where = f" in {held.workspaces[workspace_id]}" if workspace_id is not None else ""
    title = f"Stepward: {total} items wait for a person{where}"
    lines = [f"{counted}."]
    lines += [
        f"- {item.workspace} · {item.tool or 'run'}: {item.reason} {item.console_url}"
        for item in items[:TEXT_LISTED]
    ]
    if total > TEXT_LISTED:
        lines.append(f"… {total - TEXT_LISTED} more")
    lines.append(f"All of them: {link}")
    payload = {
        "event": "digest",
        "workspace": held.workspaces[workspace_id] if workspace_id is not None else None,
        "step_id": None,
        "run_id": None,
        "tool": next(iter(held.tools)) if len(held.tools) == 1 else None,
        "reason": f"{total} items wait for a person: {counted}",
        "console_url": link,
        "at": now.isoformat(),
        "count": total,
        "items": listed,
    }
    return Message(title, "\n".join(lines), payload)


# --- sending -------------------------------------------------------------------------------


WEBHOOK_SCHEMES = ("json", "jsons")


def scheme_of(url: str) -> str:
    return url.partition("://")[0].lower()


def instantiate(url: str, *, signing_key: str = "") -> Any:
    """The Apprise plugin for `url` (ours for json:// and jsons://), or None.

    Apprise is imported here, not with this module: it takes a few tenths of a second, and
    every process that loads the admin or the sweeper would pay them, sending or not."""
    if scheme_of(url) in WEBHOOK_SCHEMES:
        from executor.notifications import signed_webhook

        return signed_webhook.instantiate(url, signing_key=signing_key)
    import apprise

    return apprise.Apprise.instantiate(url, suppress_exceptions=True)


def url_problem(url: str) -> str | None:
    """Why `url` cannot be sent to, or None."""
    if "://" not in url:
        return "not a URL: an Apprise URL looks like json://host/path or mailto://user:pw@host"
    if instantiate(url) is None:
        return f"Apprise cannot send to this {scheme_of(url)}:// URL (see docs/notifications.md)"
    return None


def masked(url: str) -> str:
    """The URL with its credentials hidden (Apprise's privacy form; a webhook's headers by
    name only), for admin and logs."""
    plugin = instantiate(url)
    if plugin is None:
        return f"{scheme_of(url)}://…"
    if scheme_of(url) in WEBHOOK_SCHEMES:
        return str(plugin.masked_url())
    return redact_text(str(plugin.url(privacy=True)))


Sender = Callable[[str, Message], "str | None"]


def apprise_send(url: str, message: Message) -> str | None:
    """Sends `message` to `url` through Apprise; None when delivered, else what went wrong."""
    webhook = scheme_of(url) in WEBHOOK_SCHEMES
    if webhook and not settings.NOTIFY_SIGNING_KEY:
        return "NOTIFY_SIGNING_KEY is not set: a JSON webhook is never sent unsigned"
    plugin = instantiate(url, signing_key=settings.NOTIFY_SIGNING_KEY)
    if plugin is None:
        return f"Apprise cannot send to {masked(url)}"
    import apprise

    with apprise.LogCapture(level=logging.WARNING, fmt="%(message)s") as captured:
        if webhook:
            delivered = plugin.notify(body=message.body_json(), title="")
        else:
            delivered = plugin.notify(body=message.text, title=message.title)
    if delivered:
        return None
    return redact_text(captured.getvalue().strip() or "not delivered")[:2000]


def retry_delay(attempts: int) -> timedelta:
    """The wait after the `attempts`-th failed attempt."""
    seconds = settings.NOTIFY_RETRY_SECONDS * 2 ** (attempts - 1)
    return timedelta(seconds=min(seconds, settings.NOTIFY_RETRY_MAX_SECONDS))


def url_of(delivery: NotifyDelivery) -> str | None:
    if delivery.subscription_id is not None:
        subscription = NotifySubscription.objects.filter(
            pk=delivery.subscription_id, active=True
        ).first()
        return subscription.url if subscription else None
    for url in settings.NOTIFY_URLS:
        if setting_key(url) == delivery.subscriber:
            return url
    return None


@dataclass
class SendReport:
    sent: int = 0
    retried: int = 0
    failed: int = 0


def send_due(*, now: datetime, send: Sender = apprise_send) -> SendReport:
    """Sends each pending delivery whose digest window and retry wait are over."""
    report = SendReport()
    due = list(
        NotifyDelivery.objects.filter(status=DeliveryStatus.PENDING, send_after__lte=now)
        .filter(Q(next_attempt_at__isnull=True) | Q(next_attempt_at__lte=now))
        .order_by("send_after", "id")[:SEND_BATCH]
    )
    started = time.monotonic()
    for delivery in due:
        if time.monotonic() - started > SEND_SECONDS:
            break
        url = url_of(delivery)
        if url is None:
            delivery.status = DeliveryStatus.FAILED
            delivery.last_error = "its subscriber was removed or deactivated"
            delivery.save(update_fields=["status", "last_error"])
            report.failed += 1
            continue
        items, held = items_of(delivery)
        if not items:
            delivery.delete()  # every item archived meanwhile
            continue
        try:
            error = send(url, compose(items, held, now=now))
        except Exception as raised:  # a plugin's bug must not stop the other deliveries
            logger.exception("notify: sending to %s failed", delivery.target)
            error = redact_text(f"{type(raised).__name__}: {raised}")[:2000]
        delivery.attempts += 1
        if error is None:
            delivery.status = DeliveryStatus.SENT
            delivery.sent_at = now
            delivery.next_attempt_at = None
            report.sent += 1
        elif delivery.attempts >= settings.NOTIFY_MAX_ATTEMPTS:
            delivery.status = DeliveryStatus.FAILED
            delivery.next_attempt_at = None
            report.failed += 1
            logger.warning("notify: gave up on %s: %s", delivery.target, error)
        else:
            delivery.next_attempt_at = now + retry_delay(delivery.attempts)
            report.retried += 1
        delivery.last_error = error or ""
        delivery.save(
            update_fields=["status", "sent_at", "next_attempt_at", "attempts", "last_error"]
        )
    return report


# --- the pass ------------------------------------------------------------------------------


def take_lease(owner: str, *, now: datetime, ttl: timedelta) -> bool:
    try:
        with transaction.atomic():
            SweeperLease.objects.get_or_create(name=LEASE_NAME)
    except IntegrityError:
        pass  # created concurrently
    free = Q(expires_at__isnull=True) | Q(expires_at__lte=now) | Q(owner=owner)
    return (
        SweeperLease.objects.filter(free, name=LEASE_NAME).update(owner=owner, expires_at=now + ttl)
        == 1
    )


def release_lease(owner: str) -> None:
    SweeperLease.objects.filter(name=LEASE_NAME, owner=owner).update(
        owner="", expires_at=None, last_finished_at=timezone.now()
    )


def prune(*, now: datetime) -> int:
    """Deletes what is older than NOTIFY_KEEP_DAYS: sent and failed messages, and the
    notifications no pending message holds. A batch a pass; returns the rows deleted."""
    cut = now - timedelta(days=settings.NOTIFY_KEEP_DAYS)
    old = list(
        NotifyDelivery.objects.filter(created_at__lt=cut)
        .exclude(status=DeliveryStatus.PENDING)
        .values_list("pk", flat=True)[:BATCH]
    )
    deleted = NotifyDelivery.objects.filter(pk__in=old).delete()[0] if old else 0
    stale = list(
        Notification.objects.filter(fanned_out_at__lt=cut)
        .exclude(deliveries__status=DeliveryStatus.PENDING)
        .values_list("pk", flat=True)[:BATCH]
    )
    if stale:
        deleted += Notification.objects.filter(pk__in=stale).delete()[0]
    return deleted


@dataclass
class NotifyReport:
    handed_out: int = 0
    sent: int = 0
    retried: int = 0
    failed: int = 0
    pruned: int = 0


def notify_pass(
    *, owner: str, now: datetime | None = None, send: Sender = apprise_send
) -> NotifyReport | None:
    """One pass: new notifications into deliveries, then the due deliveries sent. None when
    another process holds the notify lease (so no message goes out twice)."""
    now = now or timezone.now()
    # Long enough for a pass of SEND_BATCH slow subscribers.
    ttl = timedelta(minutes=10)
    if not take_lease(owner, now=now, ttl=ttl):
        return None
    try:
        handed_out = 0
        for _ in range(FAN_OUT_BATCHES):
            done = fan_out(now=now)
            handed_out += done
            if done < BATCH:
                break
        sent = send_due(now=now, send=send)
        pruned = prune(now=now)
    finally:
        release_lease(owner)
    return NotifyReport(handed_out, sent.sent, sent.retried, sent.failed, pruned)
