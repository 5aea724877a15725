"""Test-only tools whose answers each test scripts, and helpers that drive the engine in-process.

The tools are registered only while a test runs (`installed`), so other suites never see
them in the registry or in `GET /api/v1/tools`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any, ClassVar

from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction
from django.utils import timezone
from guardian.shortcuts import assign_perm

from executor import engine
from executor.contract.tool import (
    FailureClass,
    Invocation,
    Lookup,
    LookupOutcome,
    RetryPolicy,
    Tool,
    ToolError,
    ToolResult,
    get_tool,
    register,
    unregister,
)
from executor.engine import progress
from executor.ledger import transitions
from executor.ledger.records import (
    Agent,
    Approval,
    ApprovalRule,
    Attempt,
    Effect,
    Event,
    Idempotency,
    Phase,
    Run,
    Step,
)
from executor.ledger.records import Tool as ToolRow
from executor.ledger.states import State
from executor.services.posting import StepRequest, step_post, steps_post
from executor.services.tools import tools_sync
from executor.worker import sweeper

DAY = 24 * 3600
# Full jitter may pick any delay from zero up, so only a long interval makes "the retry is
# not due yet" hold for the few milliseconds a test takes. Tests make a retry due by
# moving `not_before`, never by waiting.
RETRY = RetryPolicy(
    initial_interval=DAY,
    backoff_coefficient=2,
    max_interval=4 * DAY,
    max_attempts=3,
    deadline=365 * DAY,
)

Answer = FailureClass | BaseException | ToolResult | Callable[[Invocation], ToolResult]


class ScriptedTool(Tool):
    """Answers each call with the next entry of `script`, then succeeds; records every call.

    An entry is a FailureClass (raised as that ToolError), any exception (raised as is), a
    ToolResult (returned) or a function of the call (run, for a slow call). Every subclass
    gets its own `calls` and `script`.
    """

    requires_approval = ApprovalRule.NEVER
    compensation = ""
    retry = RETRY
    input_schema: ClassVar[dict[str, Any]] = {"type": "object"}

    calls: ClassVar[list[Invocation]]
    script: ClassVar[list[Answer]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.calls = []
        cls.script = []

    @classmethod
    def reset(cls) -> None:
        cls.calls.clear()
        cls.script.clear()

    @classmethod
    def will(cls, *answers: Answer) -> None:
        cls.script.extend(answers)

    def invoke(self, call: Invocation) -> ToolResult:
        cls = type(self)
        cls.calls.append(call)
        if cls.script:
            answer = cls.script.pop(0)
            if isinstance(answer, FailureClass):
                raise ToolError(answer, f"scripted {answer}")
            if isinstance(answer, BaseException):
                raise answer
            if isinstance(answer, ToolResult):
                return answer
            return answer(call)
        return ToolResult(
            result={"echo": call.input},
            external_id=f"{cls.name}-{call.operation_id}-{len(cls.calls)}",
        )


class PureTool(ScriptedTool):
    name = "test.pure"
    effect = Effect.PURE
    idempotency = Idempotency.NONE


class ReadTool(ScriptedTool):
    name = "test.read"
    effect = Effect.READ
    idempotency = Idempotency.NONE


class WriteTool(ScriptedTool):
    """A non-idempotent write without a lookup: an ambiguous outcome goes to a person."""

    name = "test.write"
    effect = Effect.WRITE
    idempotency = Idempotency.NONE


class KeyedTool(ScriptedTool):
    name = "test.keyed"
    effect = Effect.WRITE
    idempotency = Idempotency.KEY


class LookupTool(ScriptedTool):
    """A non-idempotent write whose external system answers lookups; the test sets `answer`."""

    name = "test.lookup"
    effect = Effect.WRITE
    idempotency = Idempotency.NONE
    lookup_authoritative = True

    answer: ClassVar[Lookup] = Lookup(LookupOutcome.CANNOT_TELL)
    lookups: ClassVar[list[Invocation]] = []
    # Runs inside lookup(): lets a test act while a sweep is in progress.
    during_lookup: ClassVar[Callable[[], None] | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.lookups = []

    @classmethod
    def reset(cls) -> None:
        super().reset()
        cls.lookups.clear()
        cls.answer = Lookup(LookupOutcome.CANNOT_TELL)
        cls.during_lookup = None

    def lookup(self, call: Invocation) -> Lookup:
        cls = type(self)
        cls.lookups.append(call)
        if cls.during_lookup is not None:
            cls.during_lookup()
        return cls.answer


class WeakLookupTool(LookupTool):
    """Its lookup's not_found proves nothing."""

    name = "test.lookup_weak"
    lookup_authoritative = False


class DestructiveTool(ScriptedTool):
    name = "test.destructive"
    effect = Effect.DESTRUCTIVE
    idempotency = Idempotency.NONE
    requires_approval = ApprovalRule.BY_POLICY


class UndoTool(ScriptedTool):
    """Undoes `test.undoable`; a compensation step always waits for a person's approval."""

    name = "test.undo"
    effect = Effect.WRITE
    idempotency = Idempotency.KEY


class UndoableTool(ScriptedTool):
    name = "test.undoable"
    effect = Effect.WRITE
    idempotency = Idempotency.KEY
    compensation = "test.undo"


class CostlyTool(ScriptedTool):
    name = "test.costly"
    effect = Effect.PURE
    idempotency = Idempotency.NONE

    def cost(self, result: ToolResult) -> Decimal:
        return Decimal(1)


class ShortDeadlineTool(ScriptedTool):
    """Many attempts allowed, but a short deadline for the whole operation."""

    name = "test.short_deadline"
    effect = Effect.WRITE
    idempotency = Idempotency.KEY
    retry = RetryPolicy(
        initial_interval=10, backoff_coefficient=2, max_interval=60, max_attempts=50, deadline=120
    )


TOOLS: tuple[type[ScriptedTool], ...] = (
    PureTool,
    ReadTool,
    WriteTool,
    KeyedTool,
    LookupTool,
    WeakLookupTool,
    DestructiveTool,
    UndoTool,
    UndoableTool,
    CostlyTool,
    ShortDeadlineTool,
)


@contextlib.contextmanager
def installed(agent: Agent) -> Iterator[None]:
    """Registers the test tools, mirrors them into the Tool table, lets `agent` use them."""
    for cls in TOOLS:
        cls.reset()
        register(cls)
    try:
        tools_sync()
        for row in ToolRow.objects.filter(name__in=[cls.name for cls in TOOLS]):
            assign_perm("executor.use_tool", agent.user, row)
        yield
    finally:
        for cls in TOOLS:
            unregister(cls.name)
            cls.reset()


# --- driving steps --------------------------------------------------------------------------


def post_many(agent: Agent, run: Run, tool: str, count: int) -> list[Step]:
    """`count` steps of `tool` posted in one batch, keyed `<tool>-<i>`, input `{"n": i}`."""
    steps, _ = steps_post(
        agent=agent,
        run=run,
        requests=[StepRequest(f"{tool}-{i}", tool, {"n": i}) for i in range(count)],
    )
    return steps


def assert_within_rate(
    times: list[datetime] | list[float], calls: int, seconds: float, slack: int = 0
) -> None:
    """In any stretch of `times` (sorted; datetimes, or seconds), at most `calls` + `calls`
    per `seconds` of its length (+ `slack`): a token bucket of `calls`, refilled at that
    rate."""
    for i, first in enumerate(times):
        for j in range(i, len(times)):
            last = times[j]
            length = (
                (last - first).total_seconds()
                if isinstance(last, datetime) and isinstance(first, datetime)
                else float(last) - float(first)  # type: ignore[arg-type]
            )
            allowed = calls + calls * length / seconds + slack + 1e-6
            assert j - i + 1 <= allowed, (i, j, length)


def post(
    agent: Agent,
    run: Run,
    tool: str,
    *,
    key: str | None = None,
    input: dict[str, Any] | None = None,
    depends_on: list[str] | None = None,
) -> Step:
    """Posts a step the way the API does."""
    position = Step.objects.filter(run=run).count() + 1
    step, created = step_post(
        agent=agent,
        run=run,
        key=key or f"{tool}-{position}",
        tool_name=tool,
        input=input if input is not None else {"n": position},
        depends_on=depends_on,
    )
    assert created
    return step


def reload(step: Step) -> Step:
    return Step.objects.get(pk=step.pk)


def make_due(step: Step) -> None:
    """The scheduled backoff has passed."""
    Step.objects.filter(pk=step.pk).update(not_before=timezone.now())


def expire_lease(step: Step) -> None:
    """The worker holding the step stopped renewing its lease (killed, hung, partitioned)."""
    Step.objects.filter(pk=step.pk).update(lease_expires_at=timezone.now() - timedelta(seconds=1))


def history(step: Step) -> list[tuple[str, str, str]]:
    """(from, to, actor) of every Event of the step, oldest first."""
    return list(
        Event.objects.filter(step_id=step.pk)
        .order_by("seq")
        .values_list("from_state", "to_state", "actor")
    )


def last_event(step: Step) -> Event:
    return Event.objects.filter(step_id=step.pk).order_by("-seq")[0]


def attempts(step: Step) -> list[Attempt]:
    return list(Attempt.objects.filter(step_id=step.pk).order_by("number"))


def submit(claim: engine.Claim) -> None:
    """Commit point 4 of a write, as the claim's worker does it just before calling the tool."""
    assert engine.submit(claim, now=timezone.now()) is None


def call_tool(claim: engine.Claim) -> ToolResult:
    """The claim's worker calls the tool (its answer may then be lost with the worker)."""
    call = engine.invocation(claim.step, claim.fence, claim.attempt.number)
    return claim.tool.invoke(call)


def store_response(claim: engine.Claim, result: ToolResult) -> None:
    """Commit point 6 alone: the response stored, the step verifying; point 7 never came."""
    with transaction.atomic():
        transitions.move(
            claim.step,
            State.VERIFYING,
            actor=engine.executor_actor(claim.worker),
            reason="response stored",
            fence=claim.fence,
            changes={"external_id": result.external_id, "result": result.result},
        )
        engine.close_attempt(
            claim.attempt, Phase.RESPONDED, response={"external_id": result.external_id}
        )


def run_every_automatic_path(worker: str = "later") -> None:
    """Everything that could pick a step up again without a person: a message, a drain, a sweep."""
    for step_id in Step.objects.values_list("pk", flat=True):
        engine.process(step_id, worker=worker)
    engine.drain(worker=worker, limit=100)
    sweeper.sweep(owner=worker)


def approve_as(
    user: AbstractBaseUser,
    step: Step,
    *,
    approved_at: datetime | None = None,
    expires_in: timedelta = timedelta(hours=1),
) -> Approval:
    """A reviewer's approval of the exact call, then planned → approved → pending.

    There is no reviewer service yet, so this writes what one would.
    """
    now = timezone.now()
    approved_at = approved_at or now
    approval = Approval.objects.create(
        step=step,
        input_hash=step.input_hash,
        tool=step.tool_id,
        policy_version=get_tool(step.tool_id).policy_version(),
        approver=user,
        reason="looks right",
        approved_at=approved_at,
        expires_at=approved_at + expires_in,
    )
    transitions.move(
        step, State.APPROVED, actor=f"user:{user.get_username()}", reason="approved", now=now
    )
    promoted = progress.promote_ready(run_ids=[step.run_id], steps=[step], now=now)
    assert promoted == [step]
    return approval
