"""Console test helpers: steps built in each state a reviewer meets, pages read by test id."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from html.parser import HTMLParser
from typing import Any, ClassVar

from django.contrib.auth.models import User
from django.db import transaction
from django.test import Client
from django.utils import timezone
from guardian.shortcuts import assign_perm, remove_perm

from executor import engine
from executor.common import dispatch
from executor.contract.tool import (
    Invocation,
    Lookup,
    LookupOutcome,
    RetryPolicy,
    Tool,
    ToolResult,
)
from executor.ledger import transitions
from executor.ledger.records import (
    Agent,
    ApprovalRule,
    Effect,
    Event,
    Idempotency,
    Phase,
    Run,
    Step,
)
from executor.ledger.records import Tool as ToolRow
from executor.ledger.states import State
from executor.services.posting import step_post
from executor.services.reviews import compensation_request
from executor.services.tools import tools_sync

WORKER = "console-test-worker"


class ConsoleTool(Tool):
    idempotency = Idempotency.NONE
    requires_approval = ApprovalRule.NEVER
    compensation = ""
    retry = RetryPolicy(initial_interval=10, max_interval=60, max_attempts=3, deadline=3600)
    input_schema: ClassVar[dict[str, Any]] = {"type": "object"}

    def invoke(self, call: Invocation) -> ToolResult:
        return ToolResult(result={"ok": True}, external_id=f"T-{call.operation_id}")


class GatedTool(ConsoleTool):
    """Every call needs a person's approval; a ticket it opens can be closed again."""

    name = "console.gated"
    effect = Effect.WRITE
    requires_approval = ApprovalRule.ALWAYS
    compensation = "console.undo"


class TicketTool(ConsoleTool):
    """A non-idempotent write without a lookup, undone by console.undo."""

    name = "console.ticket"
    effect = Effect.WRITE
    compensation = "console.undo"


class UndoTool(ConsoleTool):
    name = "console.undo"
    effect = Effect.WRITE


class LookupTool(ConsoleTool):
    """A write whose other system answers lookups with authority (it cannot tell, here)."""

    name = "console.lookup"
    effect = Effect.WRITE
    lookup_authoritative = True

    def lookup(self, call: Invocation) -> Lookup:
        return Lookup(LookupOutcome.CANNOT_TELL, evidence={"asked": "console.lookup"})


class SecretTool(ConsoleTool):
    name = "console.secret"
    effect = Effect.PURE
    redact = frozenset({"password"})


TOOLS: tuple[type[ConsoleTool], ...] = (GatedTool, TicketTool, UndoTool, LookupTool, SecretTool)


def reload(step: Step) -> Step:
    return Step.objects.select_related("run", "run__workspace").get(pk=step.pk)


def post(agent: Agent, run: Run, tool: str, key: str, **input: Any) -> Step:
    with dispatch.publishing(dispatch.dropping_publisher):
        step, created = step_post(
            agent=agent, run=run, key=key, tool_name=tool, input=input or {"key": key}
        )
    assert created
    return step


def claim(step: Step) -> engine.Claim:
    with dispatch.publishing(dispatch.dropping_publisher):
        claimed = engine.claim_step(step.pk, worker=WORKER)
    assert isinstance(claimed, engine.Claim), claimed
    return claimed


def submit(claimed: engine.Claim) -> None:
    assert engine.submit(claimed, now=timezone.now()) is None


def planned(agent: Agent, run: Run, key: str = "plan", tool: str = "console.gated") -> Step:
    step = post(agent, run, tool, key)
    assert step.state == State.PLANNED
    return step


def unknown(agent: Agent, run: Run, key: str = "maybe", tool: str = "console.ticket") -> Step:
    """Sent, then the connection dropped: the engine cannot tell whether it happened."""
    claimed = claim(post(agent, run, tool, key))
    submit(claimed)
    with transaction.atomic():
        engine.close_attempt(
            claimed.attempt, Phase.ERRORED, error_class="ambiguous", message="connection dropped"
        )
        transitions.move(
            claimed.step,
            State.UNKNOWN,
            actor=engine.executor_actor(WORKER),
            reason="ambiguous: the effect may or may not have happened",
            fence=claimed.fence,
            changes={"failure_class": "ambiguous", "failure_message": "connection dropped"},
        )
    return reload(claimed.step)


def dead(agent: Agent, run: Run, key: str = "gone", tool: str = "console.ticket") -> Step:
    """Retries exhausted on transient failures before anything was sent."""
    claimed = claim(post(agent, run, tool, key))
    with transaction.atomic():
        engine.close_attempt(
            claimed.attempt, Phase.ERRORED, error_class="transient", message="503 before send"
        )
        transitions.move(
            claimed.step,
            State.DEAD,
            actor=engine.executor_actor(WORKER),
            reason="transient: 3 attempts failed",
            fence=claimed.fence,
            changes={"failure_class": "transient", "failure_message": "503 before send"},
        )
    return reload(claimed.step)


def blocked(agent: Agent, run: Run, key: str = "stuck", tool: str = "console.ticket") -> Step:
    """The claim's recheck found the agent without `use_tool`; the grant is then restored."""
    step = post(agent, run, tool, key)
    row = ToolRow.objects.get(name=tool)
    remove_perm("executor.use_tool", agent.user, row)
    with dispatch.publishing(dispatch.dropping_publisher):
        outcome = engine.claim_step(step.pk, worker=WORKER)
    assign_perm("executor.use_tool", agent.user, row)
    assert outcome == State.BLOCKED, outcome
    return reload(step)


def completed(agent: Agent, run: Run, key: str = "done", tool: str = "console.ticket") -> Step:
    claimed = claim(post(agent, run, tool, key))
    submit(claimed)
    actor = engine.executor_actor(WORKER)
    with transaction.atomic():
        transitions.move(
            claimed.step,
            State.VERIFYING,
            actor=actor,
            reason="response stored",
            fence=claimed.fence,
            changes={"external_id": f"T-{key}", "result": {"ticket_id": f"T-{key}"}},
        )
        engine.close_attempt(claimed.attempt, Phase.RESPONDED, response={"external_id": f"T-{key}"})
        transitions.move(claimed.step, State.COMPLETED, actor=actor, reason="verified")
    return reload(claimed.step)


def compensation(agent: Agent, run: Run, by: User, key: str = "undo-me") -> Step:
    """A planned compensation step, requested by `by` for a completed ticket."""
    original = completed(agent, run, key=key)
    return compensation_request(
        step=original, user=by, version=original.version, reason="opened by mistake"
    )


def paused(run: Run, reason: str = "max_calls reached (2 of 2)") -> Run:
    Run.objects.filter(pk=run.pk).update(max_calls=2, used_calls=2)
    run.refresh_from_db()
    from executor.policy import authorization

    assert authorization.run_pause(run, reason=reason, now=timezone.now())
    run.refresh_from_db()
    return run


def signed_in(user: User) -> Client:
    client = Client()
    client.force_login(user)
    return client


def htmx(target: str = "", current_url: str = "") -> dict[str, str]:
    headers = {"HTTP_HX_REQUEST": "true"}
    if target:
        headers["HTTP_HX_TARGET"] = target
    if current_url:
        headers["HTTP_HX_CURRENT_URL"] = f"http://testserver{current_url}"
    return headers


def events_by(step: Step, actor: str) -> list[Event]:
    return list(Event.objects.filter(step_id=step.pk, actor=actor).order_by("seq"))


def age(step: Step, by: timedelta) -> None:
    """The step has waited `by` longer than it really has."""
    then = timezone.now() - by
    Step.objects.filter(pk=step.pk).update(updated_at=then, state_since=then)


@contextlib.contextmanager
def unchanged(step: Step) -> Iterator[None]:
    """Asserts that the block leaves the step's state, version and events as they were."""
    before = reload(step)
    count = Event.objects.filter(step_id=step.pk).count()
    yield
    after = reload(step)
    assert (after.state, after.version) == (before.state, before.version)
    assert Event.objects.filter(step_id=step.pk).count() == count


@dataclass
class Form:
    attrs: dict[str, str]
    inputs: list[dict[str, str]] = field(default_factory=list)
    buttons: list[str] = field(default_factory=list)

    def field(self, name: str) -> dict[str, str] | None:
        return next((i for i in self.inputs if i.get("name") == name), None)


@dataclass
class Page:
    """What a test needs from a rendered page: its forms, labels and tagged elements."""

    forms: list[Form] = field(default_factory=list)
    labels: dict[str, str] = field(default_factory=dict)
    elements: list[tuple[str, dict[str, str]]] = field(default_factory=list)
    text: str = ""

    def form(self, testid: str) -> Form | None:
        return next((f for f in self.forms if f.attrs.get("data-testid") == testid), None)

    def testids(self) -> set[str]:
        return {a["data-testid"] for _, a in self.elements if "data-testid" in a}

    def label_for(self, element_id: str) -> str:
        return self.labels.get(element_id, "")


class _Reader(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.page = Page()
        self.form: Form | None = None
        self.label_for: str | None = None
        self.label_text: list[str] = []
        self.in_button = False
        self.button_text: list[str] = []
        self.chunks: list[str] = []

    def handle_starttag(self, tag: str, attrs_list: list[tuple[str, str | None]]) -> None:
        attrs = {k: v or "" for k, v in attrs_list}
        self.page.elements.append((tag, attrs))
        if tag == "form":
            self.form = Form(attrs)
            self.page.forms.append(self.form)
        elif tag in ("input", "textarea", "select") and self.form is not None:
            self.form.inputs.append({"tag": tag, **attrs})
        elif tag == "label":
            self.label_for, self.label_text = attrs.get("for", ""), []
        elif tag == "button":
            self.in_button, self.button_text = True, []

    def handle_endtag(self, tag: str) -> None:
        if tag == "form":
            self.form = None
        elif tag == "label" and self.label_for is not None:
            self.page.labels[self.label_for] = " ".join("".join(self.label_text).split())
            self.label_for = None
        elif tag == "button" and self.in_button:
            self.in_button = False
            if self.form is not None:
                self.form.buttons.append(" ".join("".join(self.button_text).split()))

    def handle_data(self, data: str) -> None:
        self.chunks.append(data)
        if self.label_for is not None:
            self.label_text.append(data)
        if self.in_button:
            self.button_text.append(data)


def read(response: Any) -> Page:
    reader = _Reader()
    reader.feed(response.content.decode())
    reader.page.text = " ".join(" ".join(reader.chunks).split())
    return reader.page


BULK_STATES = (State.UNKNOWN, State.DEAD, State.PLANNED, State.BLOCKED)


def bulk_steps(run: Run, count: int, *, batch: int = 5000, tool: str = "echo") -> None:
    """`count` steps waiting for a person, inserted without events (rows only, for volume).

    They cycle through unknown, dead, planned and blocked; the row constraints hold: no
    lease outside running/verifying, a failure class on dead steps.
    """
    if not ToolRow.objects.filter(name=tool).exists():
        tools_sync()
    start = (
        Step.objects.filter(run=run)
        .order_by("-position")
        .values_list("position", flat=True)
        .first()
        or 0
    ) + 1
    for offset in range(0, count, batch):
        rows = []
        for n in range(offset, min(count, offset + batch)):
            state = BULK_STATES[n % len(BULK_STATES)]
            rows.append(
                Step(
                    run=run,
                    position=start + n,
                    key=f"bulk-{start + n}",
                    tool_id=tool,
                    input={"n": n},
                    input_hash=f"{n:064d}",
                    input_summary=f'{{"n": {n}}}',
                    state=state,
                    failure_class="transient" if state == State.DEAD else "",
                    failure_message="503" if state == State.DEAD else "",
                )
            )
        Step.objects.bulk_create(rows, batch_size=batch)
