"""What a step's completion unlocks (DESIGN.md §4, §11): its approval is used up, the step it
compensates becomes `compensated`, and approved steps whose dependencies are now completed
become `pending`. The engine, recovery and reviewers' decisions all finish steps through here.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

from django.utils import timezone

from executor.common import dispatch
from executor.ledger import transitions
from executor.ledger.records import Approval, Step
from executor.ledger.states import DEPENDENCY_DEAD_ENDS, State


def steps_completed(steps: Sequence[Step], *, now: datetime) -> None:
    """What the completion of `steps` implies, in the transaction that completed them.

    A fixed number of statements for any number of steps (plus one move per compensation).
    """
    if not steps:
        return
    Approval.objects.filter(step__in=[s.pk for s in steps], consumed_at__isnull=True).update(
        consumed_at=now
    )
    for step in steps:
        if step.compensates_id:
            compensation_completed(step=step, now=now)
    promote_ready(run_ids={s.run_id for s in steps}, now=now)


def step_completed(step: Step, *, now: datetime) -> None:
    steps_completed([step], now=now)


def compensation_completed(*, step: Step, now: datetime | None = None) -> None:
    """A completed compensation step makes the step it undoes `compensated`."""
    if step.compensates_id is None:
        return
    original = Step.objects.filter(pk=step.compensates_id, state=State.COMPLETED).first()
    if original is None:
        return
    transitions.move(
        original,
        State.COMPENSATED,
        actor="policy",
        reason=f"compensation {step.key} completed",
        data={"compensation_step": str(step.pk), "external_id": step.external_id},
        now=now,
    )


def promote_ready(
    *, run_ids: Iterable[Any], steps: Iterable[Step] | None = None, now: datetime | None = None
) -> list[Step]:
    """Moves approved steps whose dependencies are completed to pending, and wakes a worker.

    `steps` narrows it to those steps (all approved steps of the runs when None). A step
    whose dependency can never complete (rejected, cancelled, compensated) is cancelled with
    that reason rather than left waiting forever. Returns the steps made pending.
    """
    now = now or timezone.now()
    run_ids = set(run_ids)
    waiting = (
        [s for s in steps if s.state == State.APPROVED]
        if steps is not None
        else list(Step.objects.filter(run_id__in=run_ids, state=State.APPROVED))
    )
    if not waiting:
        return []
    needed = {(step.run_id, key) for step in waiting for key in step.depends_on}
    states: dict[tuple[Any, str], str] = {}
    if needed:
        rows = Step.objects.filter(
            run_id__in={run for run, _ in needed}, key__in={key for _, key in needed}
        ).values_list("run_id", "key", "state")
        states = {(run, key): state for run, key, state in rows}
    moves = []
    for step in waiting:
        dead_ends = [
            k for k in step.depends_on if states.get((step.run_id, k)) in DEPENDENCY_DEAD_ENDS
        ]
        if dead_ends:
            moves.append(
                transitions.Move(
                    step,
                    State.CANCELLED,
                    actor="policy",
                    reason=f"dependency {', '.join(dead_ends)} will never complete",
                )
            )
        elif all(states.get((step.run_id, k)) == State.COMPLETED for k in step.depends_on):
            moves.append(
                transitions.Move(
                    step,
                    State.PENDING,
                    actor="policy",
                    reason="approved; dependencies completed" if step.depends_on else "approved",
                    changes={"not_before": now, "first_scheduled_at": now},
                )
            )
    moved, _stale = transitions.move_many(moves, now=now)
    promoted = [m.step for m in moved if m.target == State.PENDING]
    dispatch.execute_many([step.pk for step in promoted])
    return promoted
