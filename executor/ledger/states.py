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
    # A reviewer's or the policy's approval; a reviewer's rejection; the agent's cancel; an
    # approval rule's refusal (policy_denied).
    S.PLANNED: frozenset({S.APPROVED, S.REJECTED, S.CANCELLED, S.FAILED}),
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

# --- the groups of states, each named once (STYLE.md) ------------------------------------------

# No move leads out of these.
TERMINAL: frozenset[State] = frozenset(s for s, targets in ALLOWED.items() if not targets)
# A worker holds the lease.
LEASED: frozenset[State] = frozenset({S.RUNNING, S.VERIFYING})
# The engine moves the step on by itself: pages showing it refresh themselves.
IN_FLIGHT: frozenset[State] = frozenset({S.APPROVED, S.PENDING, S.RUNNING, S.VERIFYING})
# Not at an outcome yet: on its way, or waiting for its approval.
IN_PROGRESS: frozenset[State] = IN_FLIGHT | {S.PLANNED}
# At an outcome, or waiting for a person to decide one: what an agent's wait returns.
SETTLED: frozenset[State] = frozenset(State) - IN_PROGRESS
# A person must decide (DESIGN.md §12).
NEEDS_REVIEW: frozenset[State] = frozenset({S.UNKNOWN, S.DEAD, S.BLOCKED})
# The run has work left: a step on its way, awaiting approval, or waiting for a person. A run
# with none is `closed` by the sweeper (executor/ledger/runs.py).
UNFINISHED: frozenset[State] = IN_PROGRESS | NEEDS_REVIEW
# What the inbox lists: the above, and planned steps awaiting approval.
INBOX: frozenset[State] = NEEDS_REVIEW | {S.PLANNED}
# The effect happened and is confirmed.
CONFIRMED: frozenset[State] = frozenset({S.COMPLETED, S.COMPENSATED})
# Over, and the ledger records no effect (a dead letter may still be replayed).
ENDED_WITHOUT_EFFECT: frozenset[State] = frozenset({S.FAILED, S.REJECTED, S.CANCELLED})
# A dependency in one of these will never complete: its dependents are cancelled.
DEPENDENCY_DEAD_ENDS: frozenset[State] = frozenset({S.REJECTED, S.CANCELLED, S.COMPENSATED})
# Nothing was submitted yet: cancelling the run cancels these.
CANCELLABLE: frozenset[State] = frozenset({S.PLANNED, S.APPROVED, S.PENDING, S.BLOCKED})

# The run report's sections (DESIGN.md §12): every state in exactly one.
REPORT_SECTIONS: dict[str, tuple[State, ...]] = {
    "completed": (S.COMPLETED,),
    "uncertain": (S.UNKNOWN, S.RUNNING, S.VERIFYING),
    "failed": (S.FAILED, S.DEAD, S.BLOCKED, S.REJECTED, S.CANCELLED),
    "compensated": (S.COMPENSATED,),
    "pending": (S.PLANNED, S.APPROVED, S.PENDING),
}
# A run's progress bar, from done through in flight to what needs a person: every state once.
PROGRESS_ORDER: tuple[State, ...] = (
    S.COMPLETED,
    S.COMPENSATED,
    S.VERIFYING,
    S.RUNNING,
    S.PENDING,
    S.APPROVED,
    S.PLANNED,
    S.UNKNOWN,
    S.BLOCKED,
    S.DEAD,
    S.FAILED,
    S.REJECTED,
    S.CANCELLED,
)


def is_allowed(source: State | str, target: State | str) -> bool:
    return State(target) in ALLOWED[State(source)]
