"""The sweeper (DESIGN.md §2): what makes a lost message, a dead worker or a passed
deadline harmless. It holds a short lease of its own, so two sweepers never act twice and
a stuck sweep stops blocking the next one when its lease runs out.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import F, Q
from django.utils import timezone

from executor import engine
from executor.common import dispatch
from executor.engine import progress, recovery
from executor.ledger import chain, counters, retention, runs
from executor.ledger.records import TAKES_WORK, Run, RunStatus, Step, SweeperLease
from executor.ledger.states import State
from executor.notifications import outbox
from executor.policy import authorization
from executor.services.tools import upstreams_relist

logger = logging.getLogger(__name__)

LEASE_NAME = "sweeper"
BATCH = 500
# How far back a sweep looks for steps that became unfinished in a closed run: many sweeps'
# worth, so that a sweeper stopped for a while still finds them.
REOPEN_LOOKS_BACK = timedelta(minutes=10)


@dataclass
class SweepReport:
    recovered: int = 0
    reconciled: int = 0
    redispatched: int = 0
    promoted: int = 0
    runs_paused: int = 0
    runs_closed: int = 0
    runs_reopened: int = 0
    cancelled: int = 0
    checkpoints: int = 0
    notified: int = 0  # messages sent (docs/notifications.md)
    counters_folded: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def lease_ttl() -> timedelta:
    return timedelta(seconds=max(30.0, settings.EXECUTOR_SWEEP_SECONDS * 6))


def take_lease(owner: str) -> bool:
    now = timezone.now()
    try:
        with transaction.atomic():
            SweeperLease.objects.get_or_create(name=LEASE_NAME)
    except IntegrityError:
        pass  # created concurrently
    free = Q(expires_at__isnull=True) | Q(expires_at__lte=now) | Q(owner=owner)
    return (
        SweeperLease.objects.filter(free, name=LEASE_NAME).update(
            owner=owner, expires_at=now + lease_ttl(), fence=F("fence") + 1
        )
        == 1
    )


def release_lease(owner: str) -> None:
    SweeperLease.objects.filter(name=LEASE_NAME, owner=owner).update(
        owner="", expires_at=None, last_finished_at=timezone.now()
    )


def sweep(*, owner: str) -> SweepReport | None:
    """One pass; None when another sweeper holds the lease. Then, outside the lease (an
    upstream slow to start must not hold it), the MCP upstreams that are due are asked for
    their tools."""
    if not take_lease(owner):
        return None
    try:
        report = sweep_once(owner=owner)
    finally:
        release_lease(owner)
    relist_upstreams()
    report.notified = send_notifications(owner)
    retain(owner=owner)
    return report


def retain(*, owner: str) -> None:
    """The daily retention pass (EXECUTOR_RETENTION_DAYS), outside the sweeper's lease: an
    archive may take minutes; it holds a lease of its own."""
    try:
        retained = retention.retention_pass(owner=owner)
    except Exception:
        logger.exception("sweeper: the retention pass failed")
        return
    if retained is not None and (retained.runs or retained.kept_changed):
        logger.info(
            "sweep: archived %d runs (%d steps) to %s; %d checkpoints pruned",
            retained.runs,
            retained.steps,
            ", ".join(retained.files),
            retained.checkpoints_pruned,
        )


def relist_upstreams() -> None:
    try:
        for listed in upstreams_relist():
            if listed.changed:
                logger.info(
                    "sweep: upstream %s lists %d tool(s)", listed.upstream, len(listed.tools)
                )
    except Exception:
        logger.exception("sweeper: listing the MCP upstreams failed")


def send_notifications(owner: str) -> int:
    """Notifications' pass (executor/outbox.py), outside the sweeper's lease: a subscriber
    slow to answer must not hold up recovery. Returns the messages sent."""
    try:
        done = outbox.notify_pass(owner=owner)
    except Exception:
        logger.exception("sweeper: sending notifications failed")
        return 0
    if done is None:
        return 0
    if done.sent or done.retried or done.failed:
        logger.info("notify: %s", asdict(done))
    return done.sent


def isolated(action: Callable[..., str], step_id: Any, *, actor: str) -> bool:
    """Runs one step's recovery; a failure is logged and the sweep goes on to the next."""
    try:
        return action(step_id, actor=actor) != engine.Outcome.SKIPPED
    except Exception:
        logger.exception(
            "sweeper: %s failed on step %s", action.__name__, step_id, extra={"step_id": step_id}
        )
        return False


def sweep_once(*, owner: str) -> SweepReport:
    report = SweepReport()
    now = timezone.now()
    actor = f"sweeper:{owner}"

    expired = Step.objects.leases_expired(now).values_list("pk", flat=True)[:BATCH]
    for step_id in expired:
        if isolated(recovery.recover_expired, step_id, actor=actor):
            report.recovered += 1

    due_lookups = Step.objects.filter(
        state=State.UNKNOWN, not_before__isnull=False, not_before__lte=now
    ).values_list("pk", flat=True)[:BATCH]
    for step_id in due_lookups:
        if isolated(recovery.reconcile, step_id, actor=actor):
            report.reconciled += 1

    # Steps a cancelled run left pending (a retry scheduled as it was cancelled).
    orphans = Step.objects.filter(state=State.PENDING, run__status=RunStatus.CANCELLED).values_list(
        "pk", flat=True
    )[:BATCH]
    for step_id in orphans:
        if isolated(engine.cancel_if_run_cancelled, step_id, actor=actor):
            report.cancelled += 1

    for run in Run.objects.filter(status=RunStatus.OPEN, deadline__lte=now)[:BATCH]:
        if authorization.run_pause(run, reason="the run's deadline passed", now=now):
            report.runs_paused += 1

    # Runs with nothing left to do leave the open set; a closed run given work again (a step
    # committed as it was closed, a reviewer's replay) is opened again.
    report.runs_reopened += runs.reopen_busy(
        since=now - REOPEN_LOOKS_BACK, limit=BATCH, actor=actor
    )
    report.runs_closed += runs.close_finished(
        older_than=now - timedelta(seconds=settings.EXECUTOR_CLOSE_RUNS_AFTER),
        limit=BATCH,
        actor=actor,
    )

    waiting_runs = (
        Step.objects.filter(state=State.APPROVED, run__status__in=TAKES_WORK)
        .values_list("run_id", flat=True)
        .distinct()[:BATCH]
    )
    with transaction.atomic():
        report.promoted += len(progress.promote_ready(run_ids=list(waiting_runs), now=now))

    # A due step untouched for a while has probably lost its message: send another.
    # A duplicate is harmless (the claim refuses it), a lost one only delays work.
    grace = timedelta(seconds=settings.EXECUTOR_REDISPATCH_AFTER)
    lost = (
        Step.objects.due(now - grace)
        .of_open_runs()
        .filter(updated_at__lte=now - grace)
        .values_list("pk", flat=True)[: BATCH * 4]
    )
    lost_ids = list(lost)
    with transaction.atomic():
        dispatch.execute_many(lost_ids)
    report.redispatched += len(lost_ids)

    # The anchor of the ledger's tamper evidence (DESIGN.md §15): where every chain stands.
    every = timedelta(seconds=settings.EXECUTOR_CHECKPOINT_SECONDS)
    if chain.checkpoint_due(every=every, now=now) and chain.checkpoint_take(now=now):
        report.checkpoints += 1

    # The counters' rows of database sessions that have ended, folded into one row each.
    report.counters_folded += counters.fold()

    if any(asdict(report).values()):
        logger.info("sweep: %s", report.as_dict())
    return report
