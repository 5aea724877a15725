"""Browser test helpers: signing in, example tools, steps in each state, page readers."""

from __future__ import annotations

from collections.abc import Callable
from decimal import Decimal
from pathlib import Path
from typing import Any, ClassVar

from django.conf import settings as django_settings
from django.contrib.auth.models import User
from django.test import Client
from guardian.shortcuts import assign_perm, remove_perm
from playwright.sync_api import BrowserContext, Locator, Page

from executor import engine
from executor.contract.tool import (
    FailureClass,
    Invocation,
    RetryPolicy,
    Tool,
    ToolError,
    ToolResult,
)
from executor.drill.processes import DeskProcess
from executor.ledger.records import (
    Agent,
    ApprovalRule,
    Effect,
    Event,
    Idempotency,
    Run,
    Step,
)
from executor.ledger.records import Tool as ToolRow
from executor.ledger.states import State
from executor.services.posting import step_post
from executor.services.tools import tool_policy_set
from tests.support import processes

CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]


# The README screenshots are 1280 px wide.
VIEWPORT = {"width": 1280, "height": 900}


DEADLINE_SECONDS = 60.0


POLL_SECONDS = 0.05


# The in-process worker is named as a real one is: host:pid.
WORKER = engine.worker_name()


def wait_until[T](
    probe: Callable[[], T], *, what: str, diagnose: Callable[[], str] | None = None
) -> T:
    """Polls `probe` until it returns something truthy; fails at the deadline."""
    return processes.wait_until(
        probe, seconds=DEADLINE_SECONDS, what=what, diagnose=diagnose, tick=POLL_SECONDS
    )


# Where STEPWARD_SCREENSHOTS=1 writes the README's screenshots.
DOCS_DIR = Path(__file__).resolve().parents[2] / "docs"


def open_page(page: Page, base_url: str, path: str) -> None:
    response = page.goto(base_url + path)
    assert response is not None, path
    assert response.status == 200, (path, response.status)


def inbox_row(page: Page, step: Step) -> Locator:
    return page.locator(f'[data-testid="inbox-row"][data-step="{step.pk}"]')


def decide(
    page: Page, form: str, button: str, reason: str, fields: dict[str, str] | None = None
) -> None:
    """Fills one decision form on the step page by its labels and submits it."""
    decision = page.get_by_test_id(form)
    for label, value in (fields or {}).items():
        decision.get_by_label(label).fill(value)
    decision.get_by_label("Reason").fill(reason)
    decision.get_by_role("button", name=button).click()


def events_by(step: Step, actor: str) -> list[Event]:
    return list(Event.objects.filter(step_id=step.pk, actor=actor).order_by("seq"))


def png_size(path: Path) -> tuple[int, int]:
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return int.from_bytes(header[16:20], "big"), int.from_bytes(header[20:24], "big")


def hand_made_post(page: Page, path: str, data: dict[str, str]) -> tuple[int, str]:
    """A POST made from the signed-in page's own script, past whatever its forms offer:
    the session's cookie and CSRF token, any URL and fields. Returns status and body."""
    answer: list[Any] = page.evaluate(
        """async ([url, fields]) => {
            const token = JSON.parse(document.body.getAttribute("hx-headers"))["X-CSRFToken"];
            const response = await fetch(url, {method: "POST", body: new URLSearchParams(fields),
                                               headers: {"X-CSRFToken": token}});
            return [response.status, await response.text()];
        }""",
        [path, data],
    )
    return int(answer[0]), str(answer[1])


def sign_in(context: BrowserContext, user: User, base_url: str) -> None:
    """Gives the browser a session of `user`, as the login form would have (test 1 uses it)."""
    client = Client()
    client.force_login(user)
    name = django_settings.SESSION_COOKIE_NAME
    context.add_cookies([{"name": name, "value": client.cookies[name].value, "url": base_url}])


class ExampleTool(Tool):
    idempotency = Idempotency.NONE
    requires_approval = ApprovalRule.NEVER
    compensation = ""
    retry = RetryPolicy(initial_interval=10, max_interval=60, max_attempts=3, deadline=3600)
    input_schema: ClassVar[dict[str, Any]] = {"type": "object"}

    def invoke(self, call: Invocation) -> ToolResult:
        return ToolResult(result={"ok": True}, external_id=f"X-{call.operation_id[:8]}")


class Refund(ExampleTool):
    """A call a person must approve, every time."""

    name = "example.refund"
    description = "Refunds a payment (a test tool): every call needs a person's approval."
    effect = Effect.WRITE
    requires_approval = ApprovalRule.ALWAYS

    def invoke(self, call: Invocation) -> ToolResult:
        refund_id = f"RF-{call.operation_id[:8]}"
        return ToolResult(result={"refund_id": refund_id}, external_id=refund_id)


class Webhook(ExampleTool):
    """Its endpoint is down: every attempt fails transiently before anything is sent."""

    name = "example.webhook"
    description = "Posts an event to a partner's webhook (a test tool whose partner is down)."
    effect = Effect.WRITE
    # The smallest backoff the contract allows: its retries are due at once.
    retry = RetryPolicy(initial_interval=0.001, max_interval=0.001, max_attempts=3, deadline=3600)

    def invoke(self, call: Invocation) -> ToolResult:
        raise ToolError(
            FailureClass.UNAVAILABLE,
            "503 Service Unavailable from hooks.partner.example before the request was read",
        )


class Summarize(ExampleTool):
    """A pure call with a cost, so that a run's budget shows spending."""

    name = "example.summarize"
    description = "Summarizes a text (a test tool that costs 0.02 per call)."
    effect = Effect.PURE

    def invoke(self, call: Invocation) -> ToolResult:
        return ToolResult(result={"summary": "three tickets, one urgent"})

    def cost(self, result: ToolResult) -> Decimal:
        return Decimal("0.02")


EXAMPLE_TOOLS: tuple[type[ExampleTool], ...] = (Refund, Webhook, Summarize)


def post(agent: Agent, run: Run, tool: str, key: str, tool_input: dict[str, Any]) -> Step:
    step, created = step_post(agent=agent, run=run, key=key, tool_name=tool, input=tool_input)
    assert created
    return step


def fresh(step: Step) -> Step:
    return Step.objects.select_related("run", "run__workspace").get(pk=step.pk)


def execute(step: Step) -> Step:
    """Runs the step's due attempt in this process, as a worker would."""
    outcome = engine.process(step.pk, worker=WORKER)
    assert outcome != engine.Outcome.SKIPPED, f"{step.key} was not claimable"
    return fresh(step)


def dead_letter(agent: Agent, run: Run, key: str) -> Step:
    """An example.webhook call retried until its attempts ran out: `dead`."""
    step = post(agent, run, "example.webhook", key, {"event": "invoice.paid", "n": key})

    def attempted() -> Step | None:
        # Each retry is due as soon as its (sub-millisecond) backoff has passed.
        engine.process(step.pk, worker=WORKER)
        current = fresh(step)
        return current if current.state == State.DEAD else None

    return wait_until(attempted, what=f"{key} to be dead")


def blocked_step(agent: Agent, run: Run, key: str) -> Step:
    """An email whose agent lost `use_tool` before the claim: the recheck blocks it."""
    # The workspace lets email.send run without approval, so only the recheck stops it.
    tool_policy_set(workspace=run.workspace, tool="email.send", approval="never")
    step = post(
        agent,
        run,
        "email.send",
        key,
        {"to": "customer@example.com", "subject": "Your ticket", "body": "We are on it."},
    )
    row = ToolRow.objects.get(name="email.send")
    remove_perm("executor.use_tool", agent.user, row)
    outcome = engine.claim_step(step.pk, worker=WORKER)
    assign_perm("executor.use_tool", agent.user, row)
    assert outcome == State.BLOCKED, outcome
    return fresh(step)


class Desk(processes.Desk):
    """A client of the running desk: what the external system itself says."""

    def __init__(self, process: DeskProcess) -> None:
        super().__init__(process.url)
        self.process = process

    def ticket(self, ticket_id: Any) -> dict[str, Any]:
        response = self.client.get(f"/tickets/{ticket_id}")
        assert response.status_code == 200, response.text
        return dict(response.json())


class WorkerProcess(processes.Worker):
    """`celery -A console worker --pool solo`: one process, so a crash ends the worker."""

    def wait_exit(self) -> int:
        return self.wait_dead(seconds=DEADLINE_SECONDS, diagnose=self.log)
