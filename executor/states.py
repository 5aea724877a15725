"""The states of a step and the table of allowed moves (DESIGN.md §4).

`transitions.py` refuses every move that is not in `ALLOWED`.
"""

from __future__ import annotations

from django.db import models


class State(models.TextChoices):
    PLANNED = "planned"
    APPROVED = "approved"
    PENDING = "pending"
    RUNNING = "running"
    VERIFYING = "verifying"
    COMPLETED = "completed"
    UNKNOWN = "unknown"
    FAILED = "failed"
    DEAD = "dead"
    BLOCKED = "blocked"
    REJECTED = "rejected"
    CANCELLED = "cancelled"
    COMPENSATED = "compensated"


S = State

ALLOWED: dict[State, frozenset[State]] = {
    # A reviewer's or the policy's approval; a reviewer's rejection; the agent's cancel.
    S.PLANNED: frozenset({S.APPROVED, S.REJECTED, S.CANCELLED}),
    # Dependencies met and budget left; a cancel (also when a dependency can never complete).
    S.APPROVED: frozenset({S.PENDING, S.CANCELLED}),
    # A worker's claim; a cancel before anything was sent.
    S.PENDING: frozenset({S.RUNNING, S.CANCELLED}),
    S.RUNNING: frozenset(
        {
            S.VERIFYING,  # the response is stored
            S.COMPLETED,  # pure and read tools: nothing to confirm
            S.PENDING,  # retry, budget pause before submission, recovery of an unsent attempt
            S.FAILED,  # a failure that will not be retried
            S.DEAD,  # retries exhausted
            S.UNKNOWN,  # the submission may have happened
            S.BLOCKED,  # authorization failed at the claim
            S.CANCELLED,  # the run was cancelled before submission
        }
    ),
    S.VERIFYING: frozenset({S.COMPLETED, S.UNKNOWN}),
    S.COMPLETED: frozenset({S.COMPENSATED}),
    S.UNKNOWN: frozenset(
        {
            S.VERIFYING,  # the lookup found it
            S.COMPLETED,  # a reviewer found it
            S.PENDING,  # confirmed not to have happened: run again, same operation_id
            S.FAILED,  # confirmed not to have happened: give up
            S.UNKNOWN,  # a lookup that could not tell, recorded
        }
    ),
    S.FAILED: frozenset({S.PENDING}),  # replay, only where DESIGN.md §7 allows
    S.DEAD: frozenset({S.PENDING}),  # a reviewer's replay of a dead letter
    S.BLOCKED: frozenset({S.PENDING, S.CANCELLED}),
    S.REJECTED: frozenset(),
    S.CANCELLED: frozenset(),
    S.COMPENSATED: frozenset(),
}

TERMINAL: frozenset[State] = frozenset(s for s, targets in ALLOWED.items() if not targets)
# States in which a worker holds the lease.
LEASED: frozenset[State] = frozenset({S.RUNNING, S.VERIFYING})
# States that wait for a person (DESIGN.md §12).
NEEDS_REVIEW: frozenset[State] = frozenset({S.UNKNOWN, S.DEAD, S.BLOCKED})
# Final for the agent's purposes: nothing more will happen without a person.
SETTLED: frozenset[State] = TERMINAL | frozenset({S.COMPLETED, S.FAILED, S.DEAD})


def is_allowed(source: State | str, target: State | str) -> bool:
    return State(target) in ALLOWED[State(source)]
