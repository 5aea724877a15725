"""Leases (DESIGN.md §5, §7): one heartbeat renews every lease a drain holds, in one
statement; a lease taken over by another worker marks its claim lost."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from django.db import connection, transaction
from django.utils import timezone

from executor.engine.common import Claim, lease_seconds, log_fields
from executor.ledger.records import Step
from executor.ledger.states import LEASED

logger = logging.getLogger(__name__)


def lock_held(claims: Sequence[Claim]) -> set[Any]:
    """Locks (in id order, as every batch does) the rows of the claims whose lease their
    worker still holds, and returns their steps' ids. Inside a transaction."""
    if not claims:
        return set()
    if connection.vendor == "postgresql":
        # (id, fence) pairs as two arrays: one statement whatever the batch's size, and
        # nothing for the ORM to build per claim.
        with connection.cursor() as cursor:
            cursor.execute(
                _LOCK_HELD_SQL,
                [[c.step.pk for c in claims], [c.fence for c in claims], [str(s) for s in LEASED]],
            )
            return {row[0] for row in cursor.fetchall()}
    # SQLite: the claim's transaction holds the database's write lock; nothing to lock.
    fences = {c.step.pk: c.fence for c in claims}
    return {
        pk
        for pk, fence in Step.objects.filter(pk__in=fences, state__in=LEASED).values_list(
            "pk", "fence"
        )
        if fences[pk] == fence
    }


_LOCK_HELD_SQL = (
    f"SELECT id FROM {Step._meta.db_table}"  # noqa: S608 - names, not input
    " WHERE (id, fence) IN (SELECT * FROM unnest(%s::uuid[], %s::integer[]))"
    " AND state = ANY(%s::text[]) ORDER BY id FOR NO KEY UPDATE"
)


def still_holds_lease(claim: Claim, *, now: datetime) -> bool:
    """Extends the lease if this worker still holds it (a fenced write)."""
    return (
        Step.objects.filter(pk=claim.step.pk, state__in=LEASED, fence=claim.fence).update(
            lease_expires_at=now + timedelta(seconds=lease_seconds())
        )
        == 1
    )


def extend_leases(claims: Sequence[Claim], *, now: datetime) -> list[Claim]:
    """Extends the leases of `claims` still held (their rows locked in id order, then one
    UPDATE, in one transaction); returns those lost to another worker (the step claimed
    again, under another fence). A claim whose step has simply moved on (completed, or taken
    by recovery) is neither extended nor lost: its drain releases it."""
    if not claims:
        return []
    until = now + timedelta(seconds=lease_seconds())
    with transaction.atomic():
        # Locked first, in the order every batch locks steps (transitions.move_many): an
        # UPDATE locks its rows in whatever order its plan meets them, and met the drain's
        # completion of the same steps the other way round (a deadlock, then leases lost).
        ours = lock_held(claims)
        Step.objects.filter(pk__in=ours).update(lease_expires_at=until)
    if len(ours) == len(claims):
        return []
    fences = dict(
        Step.objects.filter(pk__in=[c.step.pk for c in claims if c.step.pk not in ours])
        .order_by()
        .values_list("pk", "fence")
    )
    return [c for c in claims if c.step.pk in fences and fences[c.step.pk] != c.fence]


class LeaseKeeper:
    """Extends the leases of the claims a worker holds while it works on them.

    One thread and one transaction every third of the lease for all of them, however many; a
    claim whose lease another worker took over is marked `lost` (its fenced writes will be
    refused anyway) and dropped.
    """

    def __init__(self, claims: Sequence[Claim] = ()) -> None:
        self._held: dict[Any, Claim] = {c.step.pk: c for c in claims}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True, name="stepward-leases")

    def __enter__(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def hold(self, claims: Sequence[Claim]) -> None:
        with self._lock:
            self._held.update((c.step.pk, c) for c in claims)

    def release(self, claims: Sequence[Claim]) -> None:
        with self._lock:
            for c in claims:
                self._held.pop(c.step.pk, None)

    def _beat(self) -> None:
        interval = max(0.5, lease_seconds() / 3)
        try:
            while not self._stop.wait(interval):
                with self._lock:
                    held = list(self._held.values())
                for lost in extend_leases(held, now=timezone.now()):
                    lost.lost = True
                    logger.warning(
                        "lease lost on step %s",
                        lost.step.pk,
                        extra=log_fields(lost.step, lost.attempt),
                    )
                    self.release([lost])
        except Exception:  # the leases then run out, and recovery takes over
            logger.exception("the lease keeper stopped")
        finally:
            connection.close()
