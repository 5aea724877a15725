"""The PostgreSQL statements of a write's commit points when it is made alone: `submitting`
and `responded` each one statement of CTEs, atomic by itself (building them through the ORM
was most of a worker's CPU)."""

from __future__ import annotations

from datetime import datetime, timedelta
from decimal import Decimal
from functools import cache
from typing import Any

from django.db import connection

from executor.common import faults
from executor.contract.tool import ToolResult
from executor.engine.common import (
    Claim,
    closing_fields,
    lease_seconds,
    request_evidence,
    responded_move,
)
from executor.ledger import bulk, transitions
from executor.ledger.records import OPEN_PHASES, Attempt, Event, Phase, Run, RunStatus, Step
from executor.ledger.states import LEASED, State
from executor.policy import authorization


@cache
def _submit_sql() -> str:
    """`still_holds_lease` and `mark_submitting` as one statement (`submit_in_one_statement`)."""
    step, run, attempt = Step._meta, Run._meta, Attempt._meta
    return (
        f"WITH lease AS (UPDATE {step.db_table} SET lease_expires_at = %(expires)s"  # noqa: S608 - names, not input
        " WHERE id = %(step)s AND state = ANY(%(leased)s) AND fence = %(fence)s RETURNING run_id),"
        f" budget AS (UPDATE {run.db_table} SET used_calls = used_calls + 1, updated_at = %(now)s"
        f" WHERE id = (SELECT run_id FROM lease)"
        f" AND {authorization.ONE_CALL_ROOM_SQL} RETURNING id),"
        f" submitting AS (UPDATE {attempt.db_table} SET phase = %(submitting)s,"
        " submitted_at = %(now)s, request_evidence = %(evidence)s"
        " WHERE id = %(attempt)s AND phase = %(claimed)s AND EXISTS (SELECT FROM budget))"
        " SELECT EXISTS (SELECT FROM lease), EXISTS (SELECT FROM budget)"
    )


def submit_in_one_statement(claim: Claim, *, now: datetime) -> tuple[bool, bool]:
    """The `submitting` commit on PostgreSQL: the lease extended if this worker still holds
    it, one call taken from the run's budget, the attempt `submitting`, in one statement (one
    round trip, atomic by itself, the run's row locked only while it runs). Returns (the
    lease was held, the call was counted); nothing but the lease is written unless both.
    """
    step, attempt = claim.step, claim.attempt
    evidence = Attempt._meta.get_field("request_evidence").get_db_prep_save(
        request_evidence(claim.tool, step), connection
    )
    params = {
        "expires": now + timedelta(seconds=lease_seconds()),
        "step": step.pk,
        "leased": [str(state) for state in LEASED],
        "fence": claim.fence,
        "now": now,
        "open": str(RunStatus.OPEN),
        "closed": str(RunStatus.CLOSED),
        "submitting": str(Phase.SUBMITTING),
        "evidence": evidence,
        "attempt": attempt.pk,
        "claimed": str(Phase.CLAIMED),
    }
    with connection.cursor() as cursor:
        cursor.execute(_submit_sql(), params)
        held, counted = cursor.fetchone()
    if held and counted:
        attempt.phase = Phase.SUBMITTING
        attempt.submitted_at = now
    return bool(held), bool(counted)


def respond_in_one_statement(
    claim: Claim,
    result: ToolResult,
    evidence: dict[str, Any],
    cost: Decimal | None,
    *,
    actor: str,
    now: datetime,
) -> bool:
    """Commit 6 on PostgreSQL: the step to `verifying` with its response (if this worker's
    fence still holds), its Event, the attempt `responded` and the run's cost, in one
    statement. False, and nothing written, when the fence no longer holds."""
    step, attempt = claim.step, claim.attempt
    moved = transitions.plan_move(
        step, State.VERIFYING, fence=claim.fence, now=now, **responded_move(claim, result)
    )
    if_moved = "EXISTS (SELECT FROM moved)"
    closed = closing_fields(Phase.RESPONDED, response=evidence, cost=cost, now=now)
    ctes = [
        ("moved", moved.sql, moved.params),
        (
            "closed",
            *bulk.update_sql(
                Attempt,
                closed,
                where={"pk": attempt.pk},
                condition=f"phase = ANY(%s) AND {if_moved}",
                condition_params=[[str(phase) for phase in OPEN_PHASES]],
            ),
        ),
    ]
    if cost:
        ctes.append(
            (
                "costed",
                *bulk.update_sql(
                    Run,
                    {},
                    where={"pk": step.run_id},
                    increments={"used_cost": cost},
                    condition=if_moved,
                ),
            )
        )
    # Nothing is written until the statement runs: a crash here loses only the response.
    faults.hit("before_persist")
    found = bulk.insert_together([bulk.Rows(Event, [moved.event], where=if_moved)], ctes=ctes)
    if not found["moved"]:
        return False
    moved.done()
    return True
