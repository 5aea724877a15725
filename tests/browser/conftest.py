"""Browser fixtures: Debian's Chromium driven by Playwright against the live server, signed-in
sessions, a few small tools, and the ticket desk and a Celery worker as real processes on the
test's own database and on a queue of this test process.

Chromium is launched as STACK-NOTES.md says: `/usr/bin/chromium` with the flags below, never
a browser that `playwright install` would download.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any, ClassVar

import pytest
from django.conf import settings as django_settings
from django.contrib.auth.models import User
from django.test import Client
from guardian.shortcuts import assign_perm, remove_perm
from playwright.sync_api import BrowserContext, Locator, Page, expect

from console.celery import app as celery_app
from executor import dispatch, engine, services
from executor.drill.config import current_database_url
from executor.drill.processes import DeskProcess
from executor.models import (
    Agent,
    ApprovalRule,
    Effect,
    Event,
    Idempotency,
    Run,
    Step,
    Workspace,
)
from executor.models import Tool as ToolRow
from executor.states import State
from executor.tools.base import (
    FailureClass,
    Invocation,
    RetryPolicy,
    Tool,
    ToolError,
    ToolResult,
    register,
    unregister,
)
from tests.support import processes
from tests.support.cluster import own_queue

os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")  # pytest-django live_server + Playwright

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
# Deadlines only decide when a stuck test gives up, never whether a working one passes. The
# console polls its live regions every 5 s, so an auto-waiting assertion on a region that
# the server changed must be allowed a few of those.
expect.set_options(timeout=20_000)
DEADLINE_SECONDS = 60.0
POLL_SECONDS = 0.05

# The in-process worker is named as a real one is: host:pid.
WORKER = engine.worker_name()


@pytest.fixture(scope="session")
def browser_type_launch_args(browser_type_launch_args: dict[str, Any]) -> dict[str, Any]:
    return {
        **browser_type_launch_args,
        "executable_path": "/usr/bin/chromium",
        "args": [*browser_type_launch_args.get("args", []), *CHROMIUM_ARGS],
    }


@pytest.fixture(scope="session")
def browser_context_args(browser_context_args: dict[str, Any]) -> dict[str, Any]:
    return {**browser_context_args, "viewport": VIEWPORT, "device_scale_factor": 1}


@pytest.fixture(autouse=True)
def plain_static_files(settings: Any) -> None:
    # The manifest storage of the settings needs `collectstatic`, which a test run skips.
    settings.STORAGES = {
        **settings.STORAGES,
        "staticfiles": {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"},
    }


@pytest.fixture(autouse=True)
def _no_broker_messages(request: pytest.FixtureRequest) -> Iterator[None]:
    """Overrides tests/conftest.py: a test with a real worker publishes for real.

    The others drive the engine in this process and publish nothing, so no message of
    theirs waits on a broker that no worker of theirs reads.
    """
    if "worker" in request.fixturenames:
        yield
        return
    with dispatch.publishing(dispatch.dropping_publisher):
        yield


def wait_until[T](
    probe: Callable[[], T], *, what: str, diagnose: Callable[[], str] | None = None
) -> T:
    """Polls `probe` until it returns something truthy; fails at the deadline."""
    return processes.wait_until(
        probe, seconds=DEADLINE_SECONDS, what=what, diagnose=diagnose, tick=POLL_SECONDS
    )


# --- pages ----------------------------------------------------------------------------------

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


# --- signing in ---------------------------------------------------------------------------


def sign_in(context: BrowserContext, user: User, base_url: str) -> None:
    """Gives the browser a session of `user`, as the login form would have (test 1 uses it)."""
    client = Client()
    client.force_login(user)
    name = django_settings.SESSION_COOKIE_NAME
    context.add_cookies([{"name": name, "value": client.cookies[name].value, "url": base_url}])


@pytest.fixture
def bob_page(page: Page, reviewer: User, live_server: Any) -> Page:
    """A browser signed in as bob, who holds every reviewer permission on acme."""
    sign_in(page.context, reviewer, live_server.url)
    return page


@pytest.fixture
def second_reviewer(workspace: Workspace) -> User:
    """erin, a second reviewer with every reviewer permission on acme."""
    return services.reviewer_create(workspace=workspace, username="erin", password="erin-pw")


# --- tools --------------------------------------------------------------------------------


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


@pytest.fixture
def tools(agent: Agent) -> Iterator[None]:
    """Registers the example tools and lets the agent use them."""
    for cls in EXAMPLE_TOOLS:
        register(cls)
    try:
        services.tools_sync()
        for row in ToolRow.objects.filter(name__in=[cls.name for cls in EXAMPLE_TOOLS]):
            assign_perm("executor.use_tool", agent.user, row)
        yield
    finally:
        for cls in EXAMPLE_TOOLS:
            unregister(cls.name)


# --- steps, through the engine -------------------------------------------------------------


def post(agent: Agent, run: Run, tool: str, key: str, tool_input: dict[str, Any]) -> Step:
    step, created = services.step_post(
        agent=agent, run=run, key=key, tool_name=tool, input=tool_input
    )
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
    services.tool_policy_set(workspace=run.workspace, tool="email.send", approval="never")
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


# --- the ticket desk, a real process ---------------------------------------------------------


@pytest.fixture(scope="session")
def desk_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DeskProcess]:
    desk = processes.start_desk(tmp_path_factory.mktemp("browser-desk"))
    try:
        yield desk
    finally:
        desk.stop()


class Desk(processes.Desk):
    """A client of the running desk: what the external system itself says."""

    def __init__(self, process: DeskProcess) -> None:
        super().__init__(process.url)
        self.process = process

    def ticket(self, ticket_id: Any) -> dict[str, Any]:
        response = self.client.get(f"/tickets/{ticket_id}")
        assert response.status_code == 200, response.text
        return dict(response.json())


@pytest.fixture
def desk(desk_process: DeskProcess, settings: Any) -> Iterator[Desk]:
    """The desk with no faults; this process's tools point at it."""
    settings.TICKETDESK_URL = desk_process.url
    client = Desk(desk_process)
    client.faults(reset=True)
    yield client
    client.faults(reset=True)
    client.close()


# --- a Celery worker, a real process -----------------------------------------------------------


@pytest.fixture(scope="package")
def browser_queue() -> Iterator[str]:
    """A queue of this test process alone: a stranger's worker on the machine's default
    queue (one var/broker folder, one Redis list) would take our messages and skip them."""
    with own_queue("browser") as own:
        yield own


class WorkerProcess(processes.Worker):
    """`celery -A console worker --pool solo`: one process, so a crash ends the worker."""

    def wait_exit(self) -> int:
        return self.wait_dead(seconds=DEADLINE_SECONDS, diagnose=self.log)


@pytest.fixture
def worker(
    browser_queue: str, transactional_db: Any, desk: Desk, tmp_path: Path
) -> Iterator[Callable[..., WorkerProcess]]:
    """Starts workers on this test's database, broker and queue; stops them at the end.

    Short leases, so that a crashed worker's step is recoverable within the test. Start a
    worker after publishing what it should take: kombu's filesystem transport can hand a
    polling reader a message file that its writer has created but not yet written, and
    the worker then dies of a JSONDecodeError.
    """
    assert celery_app.conf.broker_url == django_settings.CELERY_BROKER_URL
    assert celery_app.amqp.router.route({}, "stepward.execute_step")["queue"].name == browser_queue
    started: list[WorkerProcess] = []

    def start(**env: str) -> WorkerProcess:
        base_env = {
            **os.environ,
            "CELERY_BROKER_URL": django_settings.CELERY_BROKER_URL,
            "CELERY_QUEUE": browser_queue,
            "STEPWARD_BROKER_DIR": str(django_settings.BROKER_DIR),
            "DATABASE_URL": current_database_url(),
            "DJANGO_SETTINGS_MODULE": "console.settings",
            "TICKETDESK_URL": desk.url,
            "EXECUTOR_LEASE_SECONDS": "2",
            "EXECUTOR_ALLOW_FAULTS": "0",
            "PYTHONUNBUFFERED": "1",
        }
        base_env.pop("EXECUTOR_FAULTS_SEED", None)
        process = WorkerProcess(
            f"browser-{os.getpid()}",
            base_env,
            tmp_path / f"worker-{len(started) + 1}.log",
            browser_queue,
        )
        started.append(process)
        return process.start(faults=env.pop("EXECUTOR_FAULTS", ""), **env)

    yield start
    for process in started:
        process.kill()
