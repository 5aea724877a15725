"""Per-tool limits across every worker (API.md "Slow tools"): `max_in_flight` (calls of the
tool leased at once) and `rate` (calls started per second, minute or hour).

Real APIs have limits of their own; a worker with hundreds of calls in flight would meet them
as 429s. So a claim takes a limited tool's steps only while the tool has room. Calls in
flight are counted from the ledger itself, its steps leased now (running or verifying): no
counter to keep right after a crash, as a killed worker's steps count until recovery
releases them, then no more. The rate is a token bucket kept on the tool's row, written in
the claim's own transaction (a claim that dies takes nothing). A claim that takes a limited
tool's steps first locks that tool's row (`executor_tool`), so two workers' claims of one
tool are counted one after the other, never both against the same room; claims that take no
limited tool lock nothing more. A tool at its limit leaves its steps `pending`.

Where the limits come from: the tool's declaration (a Python `Tool`'s attributes, a
`[[tool]]` table, an `[upstream.tools.X]` entry), mirrored into its row by `tools_sync`; an
admin's override on the row wins over it. A claim reads the rows with its steps (one join it
makes anyway): a deployment without limits pays no statement for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from django.db.models import Count
from django.utils import timezone

from executor.contract.tool import Rate, parse_rate
from executor.ledger.records import Step
from executor.ledger.records import Tool as ToolRow
from executor.ledger.states import LEASED


@dataclass(frozen=True)
class Limit:
    max_in_flight: int | None
    rate: Rate | None


def effective(row: ToolRow) -> Limit | None:
    """What the engine enforces for a tool's row: an admin's override, else the declaration;
    None for no limit."""
    in_flight = row.max_in_flight_override or row.max_in_flight
    try:
        rate = parse_rate(row.rate_override or row.rate)
    except ValueError:  # an admin's form checks it; a row edited by hand is not obeyed
        rate = None
    return Limit(in_flight, rate) if in_flight or rate else None


def allot(
    wanted: dict[str, int], limits: dict[str, Limit], *, now: datetime
) -> tuple[dict[str, int], datetime]:
    """How many of `wanted` calls each limited tool may start now, and the buckets' clock
    (the time they were counted at: the claim's attempts are claimed at it, so that their
    times are the buckets' own); the calls allotted are taken from the tools' rates. Locks
    the tools' rows (in name order) until the claim's transaction ends, so that two claims
    of one tool count one after the other.

    `max_in_flight` counts the tool's steps leased now (a partial index holds only those).
    `rate` is a token bucket on the tool's row: `calls` tokens at most, refilled at
    calls/period, one taken per call started — bursts of up to `calls`, then the rate.
    """
    rows = {
        row.name: row
        for row in ToolRow.objects.select_for_update()
        .filter(name__in=sorted(wanted))
        .order_by("name")
    }
    counted = [name for name in wanted if limits[name].max_in_flight]
    leased = (
        dict(
            Step.objects.filter(tool_id__in=counted, state__in=LEASED)
            .order_by()
            .values_list("tool_id")
            .annotate(n=Count("id"))
        )
        if counted
        else {}
    )
    # The bucket's clock is read now that the rows are locked, not at the claim's start: the
    # claims of one tool take their tokens in the order of this lock, so by this clock too.
    locked_at = max(now, timezone.now())
    allotted: dict[str, int] = {}
    for name, count in wanted.items():
        limit, row = limits[name], rows.get(name)
        room = count
        if limit.max_in_flight:
            room = min(room, limit.max_in_flight - leased.get(name, 0))
        if limit.rate and row is not None:
            tokens = _refilled(row, limit.rate, now=locked_at)
            room = min(room, int(tokens))
            room = max(0, room)
            refilled = max(locked_at, row.rate_refilled_at or locked_at)
            ToolRow.objects.filter(pk=row.pk).update(
                rate_tokens=tokens - room, rate_refilled_at=refilled
            )
        allotted[name] = max(0, room)
    return allotted, locked_at


def _refilled(row: ToolRow, rate: Rate, *, now: datetime) -> float:
    if row.rate_refilled_at is None or row.rate_tokens is None:
        return float(rate.calls)  # a full bucket
    elapsed = max(0.0, (now - row.rate_refilled_at).total_seconds())
    return min(float(rate.calls), row.rate_tokens + elapsed * rate.calls / rate.seconds)
