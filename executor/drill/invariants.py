"""The invariants of DESIGN.md §13, checked after a drill against the desk's tickets and
the ledger: `check_invariants` returns a Verdict that names every violation.

What a step's tool is comes from the registry, not from a list of names: every write of
the drill that is not a compensation opens a ticket at the drill's desk under its operation
id (the built-in desk tools, and HTTP tools from a file pointed at that desk), and a write
declared `Idempotency.NONE` must not be submitted again without proof of no effect."""

from __future__ import annotations

import itertools
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from executor.contract.tool import RETRYABLE, Effect, Idempotency, Tool, find_tool, get_tool
from executor.ledger.chain import verify_chain
from executor.ledger.records import OPEN_PHASES, Approval, Attempt, Event, Phase, Run, Step
from executor.ledger.states import LEASED, NEEDS_REVIEW, State

# Nothing more happens to a step in these states without a person.
FINAL_STATES = frozenset(
    {
        State.COMPLETED,
        State.FAILED,
        State.DEAD,
        State.BLOCKED,
        State.REJECTED,
        State.CANCELLED,
        State.COMPENSATED,
    }
)
# States the ledger uses to say "no effect happened" (or "none was confirmed").
NO_EFFECT_STATES = frozenset({State.FAILED, State.DEAD, State.CANCELLED, State.REJECTED})
# The same for a keyed tool, less `dead`: retries of an ambiguous keyed call may run out
# after the first one took effect.
KEYED_NO_EFFECT_STATES = NO_EFFECT_STATES - {State.DEAD}
WRITES = frozenset({Effect.WRITE, Effect.DESTRUCTIVE})


def is_settled(state: str, not_before: datetime | None) -> bool:
    """Final, or `unknown` with no lookup due: waiting visibly for a person."""
    if state == State.UNKNOWN:
        return not_before is None
    return state in FINAL_STATES


@dataclass
class Verdict:
    violations: list[str] = field(default_factory=list)
    duplicates: int = 0
    lost: int = 0
    left_for_review: int = 0
    counts: dict[str, int] = field(default_factory=dict)
    waiting: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.violations


def _label(step: Step) -> str:
    return f"step {step.key} ({step.tool_id}, {step.state}, {step.pk})"


def opens_ticket(step: Step, tool: Tool) -> bool:
    """Whether the step's effect is a ticket at the drill's desk under its operation id:
    a write that is not a compensation (those close the ticket of the step they undo)."""
    return tool.effect in WRITES and step.compensates_id is None


def check_invariants(
    *,
    run: Run,
    posted: Iterable[uuid.UUID],
    tickets: list[dict[str, Any]],
    effects_elsewhere: Mapping[uuid.UUID, int] | None = None,
) -> Verdict:
    """Checks every invariant of DESIGN.md §13 for the steps of `run` against the desk's
    tickets, and for steps whose effects are elsewhere (an upstream's repository) against
    `effects_elsewhere`, each such step's count of effects there. Returns the verdict; each
    violation names the step and what is wrong."""
    elsewhere = effects_elsewhere or {}
    verdict = Verdict()
    steps = {step.pk: step for step in Step.objects.filter(run=run).order_by("position")}
    attempts: dict[uuid.UUID, list[Attempt]] = defaultdict(list)
    for attempt in Attempt.objects.filter(step__run=run).order_by("step_id", "number"):
        attempts[attempt.step_id].append(attempt)
    events: dict[uuid.UUID, list[Event]] = defaultdict(list)
    for event in Event.objects.filter(run=run).order_by("step_id", "seq"):
        events[event.step_id].append(event)
    approvals: dict[uuid.UUID, list[Approval]] = defaultdict(list)
    for approval in Approval.objects.filter(step__run=run):
        approvals[approval.step_id].append(approval)
    tickets_by_ref: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for ticket in tickets:
        tickets_by_ref[str(ticket["client_ref"])].append(ticket)

    verdict.counts = dict(sorted(Counter(step.state for step in steps.values()).items()))
    violations = verdict.violations

    # 1. No step is lost.
    for step_id in posted:
        if step_id not in steps:
            verdict.lost += 1
            violations.append(f"§13.1 lost: posted step {step_id} is not in the ledger")
    for step in steps.values():
        if not is_settled(step.state, step.not_before):
            verdict.lost += 1
            why = "a lookup is still due" if step.state == State.UNKNOWN else "not settled"
            violations.append(f"§13.1 lost: {_label(step)} was left {step.state}: {why}")
        elif any(attempt.phase in OPEN_PHASES for attempt in attempts[step.pk]):
            violations.append(f"§13.1 {_label(step)} settled with an attempt still open")
        if step.state in NEEDS_REVIEW:
            verdict.left_for_review += 1
            verdict.waiting.append(
                f"{_label(step)}: {step.failure_class or '-'}: {step.failure_message[:200]}"
            )

    # 2 and 3. No confirmed work repeated, no non-idempotent write submitted twice.
    operations = {str(step.operation_id): step for step in steps.values()}
    for step in steps.values():
        tool = find_tool(step.tool_id)
        if tool is None:
            violations.append(
                f"§13.2 {_label(step)}: no tool of that name is registered here, so what it "
                "did cannot be checked"
            )
            continue
        # A pure or read call may be repeated; a write the other side cannot deduplicate
        # may not, unless its first attempt was shown to have had no effect.
        unkeyed = tool.effect in WRITES and tool.idempotency == Idempotency.NONE
        violations.extend(_repeated_work(step, attempts[step.pk], events[step.pk], unkeyed=unkeyed))
        if step.tool_id == "echo" and step.state == State.COMPLETED and step.result != step.input:
            violations.append(f"§13.2 {_label(step)} returned {step.result!r}, not its input")
        if step.pk in elsewhere:
            violations.extend(_effects_elsewhere(step, elsewhere[step.pk], unkeyed=unkeyed))
            verdict.duplicates += elsewhere[step.pk] > 1
            continue
        if not opens_ticket(step, tool):
            continue
        found = tickets_by_ref.get(str(step.operation_id), [])
        ids = [int(ticket["ticket_id"]) for ticket in found]
        if len(found) > 1:
            verdict.duplicates += 1
            violations.append(
                f"§13.3 duplicate: {_label(step)} has {len(found)} tickets at the desk for "
                f"operation {step.operation_id}: {ids}"
            )
        if step.state in (State.COMPLETED, State.COMPENSATED) and ids != [
            _as_int(step.external_id)
        ]:
            violations.append(
                f"§13.2 {_label(step)} names ticket {step.external_id!r}, the desk has {ids}"
            )
        if step.state == State.COMPENSATED and any(t["status"] != "closed" for t in found):
            violations.append(f"§11 {_label(step)} is compensated but its ticket is open")
        no_effect = NO_EFFECT_STATES if unkeyed else KEYED_NO_EFFECT_STATES
        if step.state in no_effect and found:
            violations.append(
                f"§13.2 {_label(step)}: the ledger records no effect, the desk has tickets {ids}"
            )
    for ref, found in tickets_by_ref.items():
        if ref not in operations:
            violations.append(
                f"§13.3 the desk has tickets {[t['ticket_id'] for t in found]} for {ref}, "
                "which is no drill step's operation"
            )

    # 4. No two workers act on one step at once; stale fences write nothing.
    for step in steps.values():
        violations.extend(_fence_violations(step, attempts[step.pk], events[step.pk]))

    # 5. Nothing executed without a valid authorization and a budget.
    submitted = 0
    for step in steps.values():
        for attempt in attempts[step.pk]:
            if attempt.submitted_at is None:
                continue
            submitted += 1
            if not _authorized(step, attempt, approvals[step.pk], events[step.pk]):
                violations.append(
                    f"§13.5 {_label(step)}: attempt {attempt.number} was submitted at "
                    f"{attempt.submitted_at.isoformat()} without a valid approval of this call"
                )
    run.refresh_from_db(fields=["used_calls"])
    if run.used_calls != submitted:
        violations.append(
            f"§13.5 the run counted {run.used_calls} calls, its attempts made {submitted}"
        )

    # 6. Every state change has its Event.
    chain = verify_chain(step_ids=list(steps))
    violations.extend(f"§13.6 {finding}" for finding in chain.findings)
    for step in steps.values():
        if len(events[step.pk]) != step.version:
            violations.append(
                f"§13.6 {_label(step)} is at version {step.version} with "
                f"{len(events[step.pk])} events"
            )
    return verdict


def _effects_elsewhere(step: Step, count: int, *, unkeyed: bool) -> list[str]:
    """A step whose one effect is counted outside the desk (a commit in a repository)."""
    if count > 1:
        return [f"§13.3 duplicate: {_label(step)} took effect {count} times (one expected)"]
    if step.state in (State.COMPLETED, State.COMPENSATED) and count != 1:
        return [f"§13.2 {_label(step)} is {step.state}, but took effect {count} times"]
    no_effect = NO_EFFECT_STATES if unkeyed else KEYED_NO_EFFECT_STATES
    if step.state in no_effect and count:
        return [f"§13.2 {_label(step)}: the ledger records no effect, it took effect {count}"]
    return []


def _as_int(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None


def _repeated_work(
    step: Step, attempts: list[Attempt], events: list[Event], *, unkeyed: bool
) -> list[str]:
    """A stored response is never followed by another submission (§13.2), and an
    unkeyed write is submitted again only after evidence that it had no effect (§13.3).
    """
    found: list[str] = []
    responded = [a for a in attempts if a.phase == Phase.RESPONDED]
    if len(responded) > 1:
        numbers = [a.number for a in responded]
        found.append(f"§13.2 {_label(step)} has responses stored by attempts {numbers}")
    if responded:
        first = responded[0]
        later = [a.number for a in attempts if a.number > first.number and a.submitted_at]
        if later:
            found.append(
                f"§13.2 {_label(step)} was submitted again (attempts {later}) after attempt "
                f"{first.number} stored its response"
            )
    if not unkeyed:
        return found
    sent = [a for a in attempts if a.submitted_at is not None]
    for before, after in itertools.pairwise(sent):
        assert before.submitted_at is not None
        assert after.submitted_at is not None
        # A retryable class means the call had no effect: the desk answers 503 and 429
        # before committing (an unkeyed HTTP tool calls a 503 ambiguous, not retryable).
        if before.error_class in RETRYABLE:
            continue
        window = [e for e in events if before.submitted_at <= e.created_at <= after.submitted_at]
        proven = any(
            e.data.get("lookup") == "not_found" or e.actor.startswith("user:") for e in window
        )
        if not proven:
            found.append(
                f"§13.3 {_label(step)}: attempt {after.number} was submitted although nothing "
                f"showed that attempt {before.number} ({before.phase}, "
                f"{before.error_class or 'no error'}) had no effect"
            )
    return found


def _fence_violations(step: Step, attempts: list[Attempt], events: list[Event]) -> list[str]:
    """Every move a worker made was made while it held the step's lease (§13.4).

    Walks the step's events: a worker's claim (pending → running) makes it the holder;
    any move to a state without a lease, or any move by someone else, ends the holding.
    A worker's move at any other time is a stale write that the fence should have refused.
    """
    found: list[str] = []
    fences = Counter(a.fence for a in attempts)
    for fence, count in fences.items():
        if count > 1:
            found.append(f"§13.4 {_label(step)} has {count} attempts with fence {fence}")
    workers_by_fence = {a.fence: a.worker for a in attempts}
    holder: str | None = None
    last_fence = 0
    for event in events:
        actor = event.actor
        is_worker = actor.startswith("executor:")
        worker = actor.removeprefix("executor:")
        if is_worker and event.from_state == State.PENDING and event.to_state == State.RUNNING:
            fence = int(event.data.get("fence", 0))
            if fence <= last_fence:
                found.append(
                    f"§13.4 {_label(step)}: claim at seq {event.seq} took fence {fence}, "
                    f"not above {last_fence}"
                )
            if workers_by_fence.get(fence) != worker:
                found.append(
                    f"§13.4 {_label(step)}: claim at seq {event.seq} by {worker} has no "
                    f"attempt of that worker with fence {fence}"
                )
            last_fence = max(last_fence, fence)
            holder = worker
            continue
        if is_worker and (holder != worker or event.from_state not in LEASED):
            found.append(
                f"§13.4 {_label(step)}: {event.from_state} → {event.to_state} at seq "
                f"{event.seq} was written by {worker}, which did not hold the lease "
                f"(holder: {holder or 'nobody'})"
            )
        if not is_worker or event.to_state not in LEASED:
            holder = None
    return found


def _authorized(
    step: Step, attempt: Attempt, approvals: list[Approval], events: list[Event]
) -> bool:
    """An approval of this exact call was live when the attempt was submitted (§9): a
    person's (an Approval row), or the policy's (recorded by an Event, no row) for a call
    that needs no person."""
    at = attempt.submitted_at
    assert at is not None
    try:
        tool = get_tool(step.tool_id)
    except LookupError:
        return False
    policy_version = tool.policy_version()
    if (
        not step.compensates_id
        and not tool.needs_approval(step.input)
        and any(
            isinstance(event.data, dict)
            # The policy's own move, or the post it approved as it was recorded (one Event
            # that passed through approved).
            and (event.actor == "policy" or "approved" in event.data.get("through", ()))
            and event.data.get("policy_version") == policy_version
            and event.created_at <= at
            for event in events
        )
    ):
        return True
    return any(
        approval.input_hash == step.input_hash
        and approval.tool == step.tool_id
        and approval.policy_version == policy_version
        and approval.approved_at <= at
        and (approval.revoked_at is None or approval.revoked_at > at)
        and (approval.consumed_at is None or approval.consumed_at >= at)
        and (approval.expires_at is None or approval.expires_at > at)
        for approval in approvals
    )
