"""The review desk's claims: a reviewer says "I am on it" and the team sees it.

A claim is a note, not a lock: decisions stay checked by the step's version alone (two
reviewers still cannot both decide), so a lapsed or forgotten claim never holds work up.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth.models import User
from django.db import IntegrityError, transaction
from django.db.models import Q
from django.utils import timezone

from executor.ledger.records import Step, StepClaim
from executor.ledger.states import INBOX, State
from executor.services.base import Conflict, require_perm


def _waits(step: Step) -> bool:
    return step.state in INBOX or step.state == State.FAILED


def _held_by_other(step: Step, user: User, now: datetime) -> Conflict:
    claim = StepClaim.objects.select_related("user").filter(step=step).first()
    if claim is None:  # released in between: the caller may try again
        return Conflict("The claim changed meanwhile: try again.")
    return Conflict(
        f"This step is being handled by {claim.user.get_username()} until "
        f"{claim.expires_at:%H:%M} UTC.",
        {"claimed_by": claim.user.get_username(), "until": claim.expires_at.isoformat()},
    )


def step_claim(*, step: Step, user: User, now: datetime | None = None) -> StepClaim:
    """Claims a waiting step for REVIEW_CLAIM_MINUTES (again: renews one's own claim).

    Refused while another reviewer's claim holds; a lapsed one is taken over.
    """
    require_perm(user, "review_steps", step.run.workspace)
    if not _waits(step):
        raise Conflict(f"Nothing waits for a person on this step (it is {step.state}).")
    now = now or timezone.now()
    until = now + timedelta(minutes=settings.REVIEW_CLAIM_MINUTES)
    with transaction.atomic():
        mine = StepClaim.objects.filter(step=step, user=user).update(expires_at=until)
        if not mine:
            mine = (
                StepClaim.objects.filter(step=step, expires_at__lte=now)
                .filter(~Q(user=user))
                .update(user=user, claimed_at=now, expires_at=until)
            )
        if not mine:
            try:
                with transaction.atomic():
                    StepClaim.objects.create(step=step, user=user, claimed_at=now, expires_at=until)
            except IntegrityError:
                raise _held_by_other(step, user, now) from None
    return StepClaim.objects.select_related("user").get(step=step)


def step_release(*, step: Step, user: User, now: datetime | None = None) -> None:
    """Gives one's claim up. Another reviewer's claim is theirs to release, until it lapses."""
    now = now or timezone.now()
    require_perm(user, "review_steps", step.run.workspace)
    gone, _ = StepClaim.objects.filter(Q(user=user) | Q(expires_at__lte=now), step=step).delete()
    if not gone and StepClaim.objects.filter(step=step).exists():
        raise _held_by_other(step, user, now)


def claims_clear(*, step_ids: list[Any]) -> None:
    """Decided steps wait for nobody: their claims go with the decision."""
    StepClaim.objects.filter(step_id__in=step_ids).delete()
