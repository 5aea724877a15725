"""The only code that changes `Step.state` (DESIGN.md §4, STYLE.md rule 2).

Every move is one conditional UPDATE on (id, state, version[, fence]) that must change
exactly one row, and the Event for it is inserted in the same transaction. The event's
hash covers its content and its predecessor's hash; the step row keeps the newest hash
(`head_hash`), so the chain needs no extra read or lock: the version check already
serializes a step's moves.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from datetime import datetime
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from executor.models import Event, Step
from executor.states import LEASED, State, is_allowed


class TransitionError(Exception):
    """A move was refused; nothing was changed."""


class IllegalTransition(TransitionError):
    def __init__(self, source: str, target: str) -> None:
        super().__init__(f"a step cannot move from {source} to {target}")
        self.source = source
        self.target = target


class StaleStep(TransitionError):
    """The step changed since it was read (another worker, reviewer or sweeper moved it)."""

    def __init__(self, step: Step, expected_fence: int | None = None) -> None:
        detail = f"step {step.pk} is no longer {step.state} at version {step.version}"
        if expected_fence is not None:
            detail += f" with fence {expected_fence}"
        super().__init__(detail)
        self.step = step


def event_hash(content: dict[str, Any]) -> str:
    """HMAC-SHA256 of the event's canonical JSON.

    Keyed, so that someone who can write to the database but does not hold the key cannot
    forge a consistent chain after an edit (a plain hash could simply be recomputed).
    """
    canonical = json.dumps(content, sort_keys=True, separators=(",", ":"), default=str)
    return hmac.new(ledger_key(), canonical.encode(), hashlib.sha256).hexdigest()


def ledger_key() -> bytes:
    key: str = settings.EXECUTOR_LEDGER_KEY
    return key.encode()


def build_event(
    step: Step,
    *,
    seq: int,
    source: str,
    target: str,
    actor: str,
    reason: str,
    data: dict[str, Any] | None,
    at: datetime,
) -> Event:
    event = Event(
        run_id=step.run_id,
        step_id=step.pk,
        seq=seq,
        from_state=source,
        to_state=target,
        actor=actor,
        reason=reason,
        data=data or {},
        created_at=at,
        prev_hash=step.head_hash,
    )
    event.hash = event_hash(event.content())
    return event


def move(
    step: Step,
    target: State,
    *,
    actor: str,
    reason: str = "",
    fence: int | None = None,
    changes: dict[str, Any] | None = None,
    data: dict[str, Any] | None = None,
    now: datetime | None = None,
    lease_expired_by: datetime | None = None,
) -> Step:
    """Moves `step` from the state and version it was read at to `target`.

    `lease_expired_by`, for recovery, also requires the lease to have run out by then: a
    worker's `submitting` commit extends the lease without a new version, so this is what
    keeps recovery from acting on a phase it read before that commit.

    `changes` are further fields written in the same UPDATE. `fence`, when given, must
    still match: a worker whose lease was taken over writes nothing. On success the
    in-memory `step` is updated and returned; otherwise `TransitionError` is raised and
    neither the step nor the ledger changed.
    """
    source = State(step.state)
    if not is_allowed(source, target):
        raise IllegalTransition(source, target)
    now = now or timezone.now()
    changes = dict(changes or {})
    if target in LEASED:
        if not (
            changes.get("lease_owner", step.lease_owner)
            and changes.get("lease_expires_at", step.lease_expires_at)
        ):
            raise TransitionError(f"a move to {target} needs a lease owner and expiry")
    else:
        changes.setdefault("lease_owner", "")
        changes.setdefault("lease_expires_at", None)
    if target in (State.FAILED, State.DEAD) and not changes.get(
        "failure_class", step.failure_class
    ):
        raise TransitionError(f"a move to {target} needs a failure_class")
    new_version = step.version + 1
    event = build_event(
        step,
        seq=new_version,
        source=source,
        target=target,
        actor=actor,
        reason=reason,
        data=data,
        at=now,
    )
    guard: dict[str, Any] = {"pk": step.pk, "state": source, "version": step.version}
    if fence is not None:
        guard["fence"] = fence
    if lease_expired_by is not None:
        guard["lease_expires_at__lte"] = lease_expired_by
    with transaction.atomic():
        updated = Step.objects.filter(**guard).update(
            state=target,
            version=F("version") + 1,
            head_hash=event.hash,
            updated_at=now,
            **changes,
        )
        if updated != 1:
            raise StaleStep(step, fence)
        event.save(force_insert=True)
    for name, value in changes.items():
        setattr(step, name, value)
    step.state = target
    step.version = new_version
    step.head_hash = event.hash
    step.updated_at = now
    return step


def insert(step: Step, *, actor: str, reason: str = "", now: datetime | None = None) -> Step:
    """Inserts a new step with its first Event (version 1, from nothing to its state)."""
    now = now or timezone.now()
    event = build_event(
        step,
        seq=step.version,
        source="",
        target=step.state,
        actor=actor,
        reason=reason,
        data=None,
        at=now,
    )
    step.head_hash = event.hash
    with transaction.atomic():
        step.save(force_insert=True)
        event.save(force_insert=True)
    return step
