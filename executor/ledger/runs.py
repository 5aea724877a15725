"""The only code that changes `Run.status`, and the only writer of RunEvents.

A run is `open` (its steps may run), `closed` (nothing left to do: no step on its way,
awaiting approval or waiting for a person; a step posted opens it again), `paused` (a budget
ran out or its deadline passed; a person extends the budget and resumes it) or `cancelled`
(for good: its pending work is cancelled, nothing resumes it). Every move is one conditional
UPDATE on the run's current status that must change a row; the RunEvent that records it is
written only when it did, in the same transaction. What else a move implies (cancelling the
run's steps, dispatching its due steps again) belongs to the service that asks for the move.

| action            | from                 | to        | function          |
|-------------------|----------------------|-----------|-------------------|
| closed            | open                 | closed    | `close_finished`  |
| reopened          | closed               | open      | `reopen`          |
| paused            | open, closed         | paused    | `pause`           |
| resumed           | paused               | open      | `resume`          |
| cancelled         | open, closed, paused | cancelled | `cancel`          |
| budget_extended   | (no move)            |           | `budget_extended` |

A step posted into a closed run, replayed in it or asked for as a compensation opens it
again at once (`reopen`, by the service that made the work). A closed run takes work as an
open one does (`TAKES_WORK`): a step committed into it as the sweeper closed it runs all the
same, and the sweeper opens the run again (`reopen_busy`).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.db import transaction
from django.db.models import Exists, F, OuterRef
from django.utils import timezone

from executor.ledger.records import Run, RunAction, RunEvent, RunStatus, Step
from executor.ledger.seals import run_seal
from executor.ledger.states import UNFINISHED
from executor.ledger.transitions import event_hash


def pause(run: Run, *, reason: str, actor: str = "policy", now: datetime | None = None) -> bool:
    """open → paused with its reason; False (and no event) if the run was not open."""
    return _move(
        run,
        RunAction.PAUSED,
        source=(RunStatus.OPEN, RunStatus.CLOSED),
        target=RunStatus.PAUSED,
        actor=actor,
        reason=reason,
        now=now,
        pause_reason=reason[:500],
    )


def resume(run: Run, *, actor: str, reason: str, now: datetime | None = None) -> bool:
    """paused → open; False (and no event) if the run was not paused."""
    return _move(
        run,
        RunAction.RESUMED,
        source=(RunStatus.PAUSED,),
        target=RunStatus.OPEN,
        actor=actor,
        reason=reason,
        now=now,
        pause_reason="",
    )


def cancel(run: Run, *, actor: str, reason: str, now: datetime | None = None) -> bool:
    """open or paused → cancelled; False (and no event) if it was cancelled already."""
    return _move(
        run,
        RunAction.CANCELLED,
        source=(RunStatus.OPEN, RunStatus.CLOSED, RunStatus.PAUSED),
        target=RunStatus.CANCELLED,
        actor=actor,
        reason=reason,
        now=now,
        pause_reason="",
    )


def reopen(run: Run, *, actor: str, reason: str, now: datetime | None = None) -> bool:
    """closed → open; False (and no event) if the run was not closed."""
    return _move(
        run,
        RunAction.REOPENED,
        source=(RunStatus.CLOSED,),
        target=RunStatus.OPEN,
        actor=actor,
        reason=reason,
        now=now,
        pause_reason="",
    )


def _unfinished_step() -> Exists:
    return Exists(Step.objects.filter(run=OuterRef("pk"), state__in=UNFINISHED))


def close_finished(*, older_than: datetime, limit: int, actor: str) -> int:
    """open → closed for up to `limit` runs made before `older_than` that have no unfinished
    step (each a probe of the step(run, state) index); returns how many were closed. The
    UPDATE checks again, so a step posted since the look keeps its run open; one committed
    as the UPDATE runs may still see it closed, and `reopen_busy` opens it again."""
    found = list(
        Run.objects.filter(status=RunStatus.OPEN, created_at__lt=older_than)
        .exclude(_unfinished_step())
        .order_by("updated_at")
        .values_list("pk", flat=True)[:limit]
    )
    closed = 0
    for pk in found:
        closed += _move(
            Run(pk=pk, version=0),
            RunAction.CLOSED,
            source=(RunStatus.OPEN,),
            target=RunStatus.CLOSED,
            actor=actor,
            reason="nothing left to do",
            now=None,
            pause_reason="",
            also=~_unfinished_step(),
        )
    return closed


def reopen_busy(*, since: datetime, limit: int, actor: str) -> int:
    """closed → open for up to `limit` closed runs with a step that became unfinished since
    `since` (a step committed as its run was closed): found from the
    steps' side, in the step(state, state_since) index, so that the look costs what changed
    lately, not every run ever closed nor every step in progress. Returns how many were
    opened."""
    found = list(
        Step.objects.filter(
            state__in=UNFINISHED, state_since__gte=since, run__status=RunStatus.CLOSED
        )
        .order_by()
        .values_list("run_id", flat=True)
        .distinct()[:limit]
    )
    return sum(
        reopen(Run(pk=pk, version=0), actor=actor, reason="a step of the run is unfinished")
        for pk in found
    )


def budget_extended(run: Run, *, actor: str, reason: str, data: dict[str, Any]) -> RunEvent:
    """Records a budget raise the caller has saved on the (locked) run; no status moves."""
    return _record(run.pk, RunAction.BUDGET_EXTENDED, actor=actor, reason=reason, data=data)


def _record(
    run_id: Any,
    action: RunAction,
    *,
    actor: str,
    reason: str,
    data: dict[str, Any] | None = None,
) -> RunEvent:
    """Appends a RunEvent to the run's chain and seals the run's budgets to it (DESIGN.md
    §15). Called with the run's row locked by the caller's write, in its transaction, so
    two records of one run never link to the same predecessor."""
    head = (
        RunEvent.objects.filter(run_id=run_id).order_by("-pk").values_list("hash", flat=True)
    ).first() or ""
    event = RunEvent(
        run_id=run_id,
        action=action,
        actor=actor,
        reason=reason,
        data=data or {},
        # When it is written, as the chain's order (ids) has it; not the caller's `now`.
        created_at=timezone.now(),
        prev_hash=head,
    )
    event.hash = event_hash(event.content())
    event.save(force_insert=True)
    budgets = Run.objects.only("max_calls", "max_cost", "deadline").get(pk=run_id)
    Run.objects.filter(pk=run_id).update(seal=run_seal(budgets, event.hash))
    return event


def _move(
    run: Run,
    action: RunAction,
    *,
    source: tuple[RunStatus, ...],
    target: RunStatus,
    actor: str,
    reason: str,
    now: datetime | None,
    pause_reason: str,
    also: Any = None,  # one more condition on the row (an expression)
) -> bool:
    now = now or timezone.now()
    with transaction.atomic():
        moved = (
            Run.objects.filter(
                *([also] if also is not None else []), pk=run.pk, status__in=source
            ).update(
                status=target,
                pause_reason=pause_reason,
                version=F("version") + 1,
                updated_at=now,
            )
            == 1
        )
        if moved:
            _record(run.pk, action, actor=actor, reason=reason)
    if moved:
        run.status, run.pause_reason = target, pause_reason
        run.version += 1
    return moved
