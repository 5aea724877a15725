"""A Python client for Stepward's agents' API (API.md), for agent programs.

It needs only the standard library and httpx: copy this file into an agent, or import it.
It retries its own calls safely (every create is idempotent by key), long-polls steps
until they settle, and turns the API's `{"error": {code, message, details}}` into typed
exceptions. Against `make run` (it prints the demo agent's token at start)::

    import os
    from stepward_client import Stepward, WaitTimeout

    tickets = {"printer": "Printer on floor 3 jams", "vpn": "VPN drops every hour"}
    with Stepward("http://127.0.0.1:8000", os.environ["STEPWARD_TOKEN"]) as client:
        # The same run key after a restart gives back the same run: nothing is posted twice.
        run = client.run("morning triage", key="triage-2025-06-02")
        for slug, title in tickets.items():
            # Keys come from the agent's plan, so a re-posted step is the one already there.
            step = run.step(f"ticket:{slug}", "ticketdesk.create", {"title": title})
            try:
                step = step.wait(timeout=120)
            except WaitTimeout as stuck:
                print(f"{slug}: still {stuck.step.state}; the executor will finish it")
                continue
            if step.state == "completed":
                print(f"{slug}: ticket {step.external_id}")
            elif step.state == "unknown":
                print(f"{slug}: may or may not have happened; a reviewer has it")
            else:
                print(f"{slug}: {step.state} {step.failure}")
        print(run.report().summary)

`Stepward(url)` takes the server's root or its `/api/v1` URL.

One file on purpose (about 700 lines): agents copy it into their own code.
"""

from __future__ import annotations

import email.utils
import random
import time
import uuid
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

import httpx

__all__ = [
    "IN_PROGRESS",
    "SETTLED",
    "STATES",
    "Conflict",
    "ConnectionFailed",
    "Forbidden",
    "InvalidRequest",
    "NotFound",
    "RateLimited",
    "Report",
    "ReportEntry",
    "Run",
    "ServerError",
    "Step",
    "StepSpec",
    "Stepward",
    "StepwardError",
    "Unauthorized",
    "WaitTimeout",
]

API_PREFIX = "/api/v1"
STATES: frozenset[str] = frozenset(
    {
        "planned",
        "approved",
        "pending",
        "running",
        "verifying",
        "completed",
        "unknown",
        "failed",
        "dead",
        "blocked",
        "rejected",
        "cancelled",
        "compensated",
    }
)
# On its way: the executor moves the step on without anyone's help (except `planned`, which
# waits for a reviewer's approval when the tool requires one).
IN_PROGRESS: frozenset[str] = frozenset({"planned", "approved", "pending", "running", "verifying"})
# Nothing more happens by itself: the outcome is known (completed, failed, ...) or waits for
# a person (unknown, dead, blocked). `Step.wait` returns on these by default.
SETTLED: frozenset[str] = STATES - IN_PROGRESS

# The server holds a long poll at most this long (API.md: `?wait=N`, N <= 30).
MAX_WAIT_PER_CALL = 30.0
# Exponential backoff grows to this and no further.
MAX_BACKOFF_SECONDS = 30.0
# A Retry-After longer than this is not slept through: the agent gets RateLimited at once
# and decides itself, rather than a call that blocks for minutes.
MAX_RETRY_AFTER_SECONDS = 60.0
RETRYABLE_STATUSES = frozenset({429, 502, 503, 504})
STEPS_PAGE = 1000
# Most steps one batch post may carry (API.md).
BATCH_MAX = 500


# --- errors -------------------------------------------------------------------------------


class StepwardError(Exception):
    """An answer or a failure of the API; `status` is None when no HTTP answer came."""

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        code: str = "error",
        details: Any = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.code = code
        self.details = details

    def __str__(self) -> str:
        prefix = f"{self.status} {self.code}" if self.status is not None else self.code
        return f"{prefix}: {self.message}"


class Unauthorized(StepwardError):
    """401: the token is missing, wrong, or its agent was deactivated."""


class Forbidden(StepwardError):
    """403: the agent may not do this (e.g. it lacks `use_tool` on the tool)."""


class NotFound(StepwardError):
    """404: no such run or step, or not visible to this agent."""


class Conflict(StepwardError):
    """409: e.g. the step key is taken by another call, or the run takes no new steps."""


class InvalidRequest(StepwardError):
    """400, 413 or 422: the body is malformed, too large, or does not fit the schema."""


class RateLimited(StepwardError):
    """429, still after the retries; `retry_after` is the server's advice in seconds."""

    def __init__(self, message: str, *, retry_after: float | None = None, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.retry_after = retry_after


class ServerError(StepwardError):
    """5xx: the server failed (502/503/504 only after the retries)."""


class ConnectionFailed(StepwardError):
    """No answer (refused, reset, timed out) after `attempts` tries."""

    def __init__(self, message: str, *, attempts: int) -> None:
        super().__init__(message, code="connection_failed")
        self.attempts = attempts


class WaitTimeout(StepwardError):
    """`Step.wait` ran out of time; `step` is the step as last seen, still in progress."""

    def __init__(self, message: str, *, step: Step) -> None:
        super().__init__(message, code="wait_timeout")
        self.step = step


ERRORS_BY_STATUS: dict[int, type[StepwardError]] = {
    400: InvalidRequest,
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    409: Conflict,
    413: InvalidRequest,
    422: InvalidRequest,
}


def _retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("Retry-After")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - datetime.now(UTC)).total_seconds())


def error_from_response(response: httpx.Response) -> StepwardError:
    """The typed exception for an error answer, from its `{"error": {...}}` body if it has one."""
    status = response.status_code
    code, message, details = f"http_{status}", response.reason_phrase or "error", None
    try:
        body = response.json()
    except ValueError:
        body = None
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        code = str(error.get("code") or code)
        message = str(error.get("message") or message)
        details = error.get("details")
    elif response.text:
        # A proxy's page, not the API's: enough of it to recognise.
        message = response.text.strip()[:200] or message
    if status == 429:
        retry_after = _retry_after(response)
        advised = details.get("retry_after_seconds") if isinstance(details, dict) else None
        if retry_after is None and isinstance(advised, int | float):
            retry_after = float(advised)
        return RateLimited(
            message, retry_after=retry_after, status=status, code=code, details=details
        )
    cls = ERRORS_BY_STATUS.get(status, ServerError if status >= 500 else StepwardError)
    return cls(message, status=status, code=code, details=details)


# --- records --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReportEntry:
    step_id: str
    key: str
    tool: str
    state: str
    external_id: str
    evidence: dict[str, Any]

    @classmethod
    def from_api(cls, raw: dict[str, Any]) -> ReportEntry:
        return cls(
            step_id=raw["step_id"],
            key=raw["key"],
            tool=raw["tool"],
            state=raw["state"],
            external_id=raw.get("external_id", ""),
            evidence=raw.get("evidence") or {},
        )


@dataclass(frozen=True)
class Report:
    """GET /runs/{id}/report: each step in its section, the usage, and one summary line."""

    completed: list[ReportEntry]
    uncertain: list[ReportEntry]
    failed: list[ReportEntry]
    compensated: list[ReportEntry]
    pending: list[ReportEntry]
    usage: dict[str, Any]
    summary: str
    raw: dict[str, Any] = field(repr=False)

    @classmethod
    def from_api(cls, raw: dict[str, Any]) -> Report:
        def section(name: str) -> list[ReportEntry]:
            return [ReportEntry.from_api(entry) for entry in raw.get(name) or []]

        return cls(
            completed=section("completed"),
            uncertain=section("uncertain"),
            failed=section("failed"),
            compensated=section("compensated"),
            pending=section("pending"),
            usage=raw.get("usage") or {},
            summary=raw.get("summary", ""),
            raw=raw,
        )


class _Record:
    """A record as the API last answered it: `raw` is the API's dict."""

    def __init__(self, client: Stepward, raw: dict[str, Any], *, created: bool = False) -> None:
        self._client = client
        self.raw = raw
        # Whether the POST that returned this record created it (201), rather than found it.
        self.created = created

    @property
    def id(self) -> str:
        return str(self.raw["id"])


class Step(_Record):
    """A step as last read; `refresh()` and `wait()` read it again."""

    @property
    def run_id(self) -> str:
        return str(self.raw["run_id"])

    @property
    def key(self) -> str:
        return str(self.raw["key"])

    @property
    def tool(self) -> str:
        return str(self.raw["tool"])

    @property
    def state(self) -> str:
        return str(self.raw["state"])

    @property
    def version(self) -> int:
        return int(self.raw["version"])

    @property
    def external_id(self) -> str:
        return str(self.raw.get("external_id") or "")

    @property
    def result(self) -> Any:
        return self.raw.get("result")

    @property
    def failure(self) -> dict[str, str] | None:
        """`{"class": ..., "message": ...}` for a failed, dead or uncertain step, else None."""
        failure: dict[str, str] | None = self.raw.get("failure")
        return failure

    @property
    def operation_id(self) -> str:
        return str(self.raw["operation_id"])

    @property
    def attempt_count(self) -> int:
        return int(self.raw.get("attempt_count", 0))

    @property
    def input_summary(self) -> str:
        return str(self.raw.get("input_summary", ""))

    @property
    def settled(self) -> bool:
        return self.state in SETTLED

    def refresh(self) -> Step:
        self.raw = self._client._get_step_raw(self.id)
        return self

    def wait(
        self,
        timeout: float = 60.0,
        until: Collection[str] | Callable[[Step], bool] | None = None,
    ) -> Step:
        """Long-polls the step until `until` holds, and returns it (updated in place).

        `until` is a set of state names or a predicate on the Step. By default it is
        `SETTLED`: any state but planned, approved, pending, running and verifying — so a
        step that needs a reviewer's approval is waited on while it is `planned`, and an
        `unknown`, `dead` or `blocked` one is returned (a person has it now). If the step
        already satisfies `until`, it is read once and returned. Raises `WaitTimeout` (its
        `.step` up to date) when `timeout` seconds pass first.
        """
        done = _condition(until)
        deadline = time.monotonic() + timeout
        if done(self):
            self.refresh()
        while not done(self):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WaitTimeout(
                    f"step {self.key!r} is still {self.state} after {timeout:g} s", step=self
                )
            # `version` makes the server answer at once if the step moved since it was read
            # here, so no change between two polls is missed.
            self.raw = self._client._get_step_raw(
                self.id, wait=min(MAX_WAIT_PER_CALL, remaining), version=self.version
            )
        return self

    def __repr__(self) -> str:
        return f"<Step {self.key!r} {self.tool} {self.state} v{self.raw.get('version')}>"


def _condition(
    until: Collection[str] | Callable[[Step], bool] | None,
) -> Callable[[Step], bool]:
    if until is None:
        return lambda step: step.state in SETTLED
    if callable(until):
        return until
    if isinstance(until, str):
        # A lone string would be taken as a set of letters.
        until = {until}
    states = frozenset(until)
    unknown = states - STATES
    if unknown:
        raise ValueError(f"no such state: {', '.join(sorted(unknown))}")
    return lambda step: step.state in states


@dataclass(frozen=True)
class StepSpec:
    """One item of `Run.steps([...])`: the same fields as `Run.step`."""

    key: str
    tool: str
    input: dict[str, Any]
    summary: str | None = None
    depends_on: tuple[str, ...] = ()

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"key": self.key, "tool": self.tool, "input": self.input}
        if self.summary is not None:
            body["summary"] = self.summary
        if self.depends_on:
            body["depends_on"] = list(self.depends_on)
        return body


class Run(_Record):
    """A run as last read."""

    @property
    def name(self) -> str:
        return str(self.raw["name"])

    @property
    def key(self) -> str | None:
        key: str | None = self.raw.get("key")
        return key

    @property
    def status(self) -> str:
        """open, paused, closed or cancelled."""
        return str(self.raw["status"])

    @property
    def pause_reason(self) -> str:
        return str(self.raw.get("pause_reason") or "")

    @property
    def usage(self) -> dict[str, Any]:
        usage: dict[str, Any] = self.raw.get("usage") or {}
        return usage

    @property
    def counts(self) -> dict[str, int]:
        """Steps in each state; a state with none is absent."""
        counts: dict[str, int] = self.raw.get("counts") or {}
        return counts

    def step(
        self,
        key: str,
        tool: str,
        input: dict[str, Any],
        summary: str | None = None,
        depends_on: list[str] | None = None,
    ) -> Step:
        """Posts a step (or gets the one already posted with this key and the same call).

        Raises Conflict if the key was posted with another call, InvalidRequest for an
        unknown tool or input that does not fit its schema (`details` says where).
        """
        body: dict[str, Any] = {"key": key, "tool": tool, "input": input}
        if summary is not None:
            body["summary"] = summary
        if depends_on:
            body["depends_on"] = list(depends_on)
        response = self._client._request("POST", f"/runs/{_segment(self.id)}/steps", json=body)
        return Step(self._client, _json(response), created=response.status_code == 201)

    def steps(self, items: Sequence[StepSpec | dict[str, Any]] | None = None) -> list[Step]:
        """Without `items`: all the run's steps in posting order (read page by page).

        With `items`: posts them as batches (API.md `POST /runs/{id}/steps/batch`) and returns
        the steps in the same order. Each item is a StepSpec or a dict `{key, tool, input,
        summary?, depends_on?}`; `depends_on` may name earlier items. A batch is all or
        nothing; a list longer than BATCH_MAX goes as several batches, each all or nothing,
        and since every item is idempotent by key the whole call is safe to repeat.
        """
        if items is None:
            return list(self.iter_steps())
        bodies = [item.body() if isinstance(item, StepSpec) else dict(item) for item in items]
        steps: list[Step] = []
        for start in range(0, len(bodies), BATCH_MAX):
            response = self._client._request(
                "POST",
                f"/runs/{_segment(self.id)}/steps/batch",
                json={"steps": bodies[start : start + BATCH_MAX]},
            )
            for raw in _json(response)["steps"]:
                steps.append(Step(self._client, raw, created=bool(raw.get("created"))))
        return steps

    def iter_steps(self) -> Iterator[Step]:
        after = 0
        while True:
            page = _json(
                self._client._request(
                    "GET",
                    f"/runs/{_segment(self.id)}/steps",
                    params={"after": after, "limit": STEPS_PAGE},
                )
            )
            for raw in page:
                yield Step(self._client, raw)
            if len(page) < STEPS_PAGE:
                return
            after = int(page[-1]["position"])

    def refresh(self) -> Run:
        self.raw = _json(self._client._request("GET", f"/runs/{_segment(self.id)}"))
        return self

    def cancel(self, reason: str | None = None) -> Run:
        """Cancels the run: steps not yet submitted are cancelled; in-flight ones finish."""
        body = {"reason": reason} if reason is not None else {}
        self.raw = _json(
            self._client._request("POST", f"/runs/{_segment(self.id)}/cancel", json=body)
        )
        return self

    def report(self) -> Report:
        return Report.from_api(
            _json(self._client._request("GET", f"/runs/{_segment(self.id)}/report"))
        )

    def __repr__(self) -> str:
        return f"<Run {self.name!r} {self.id} {self.raw.get('status')}>"


def _segment(value: str) -> str:
    return quote(str(value), safe="")


def _json(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        raise StepwardError(
            f"the answer to {response.request.method} {response.request.url.path} is not JSON",
            status=response.status_code,
            code="invalid_response",
        ) from None


# --- the client -------------------------------------------------------------------------------


class Stepward:
    """The agents' API with an agent's token.

    Calls that get no answer (refused, reset, timed out), a 429 (after its Retry-After) or a
    502/503/504 are retried up to `retries` more times with exponential backoff (`backoff`
    seconds doubling, full jitter). That is safe for POSTs too because every create is
    idempotent by key: `run()` always sends one and `Run.step()` always has the agent's.
    Other 4xx answers are never retried. `transport` is passed to httpx (for tests).
    """

    def __init__(
        self,
        url: str,
        token: str,
        *,
        timeout: float = 30.0,
        retries: int = 5,
        backoff: float = 0.5,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        if not token:
            raise ValueError("a token is required (manage.py create_agent prints one)")
        if retries < 0 or backoff < 0 or timeout <= 0:
            raise ValueError("retries and backoff must be >= 0, timeout > 0")
        base = url.rstrip("/")
        if not base.endswith(API_PREFIX):
            base += API_PREFIX
        self.url = base
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff
        self._http = httpx.Client(
            base_url=base,
            headers={"Authorization": f"Bearer {token}", "Accept": "application/json"},
            timeout=timeout,
            transport=transport,
        )

    # -- the API --

    def tools(self) -> list[dict[str, Any]]:
        """The registered tools: name, effect, idempotency, input_schema, usable, ..."""
        tools: list[dict[str, Any]] = _json(self._request("GET", "/tools"))
        return tools

    def run(
        self,
        name: str,
        key: str | None = None,
        budget: dict[str, Any] | None = None,
    ) -> Run:
        """Creates a run, or gets the agent's run with this key (then `run.created` is False).

        Give a key derived from the task to resume the same run after a restart. Without
        one a fresh key is made here, so that retries of this call still create one run.
        `budget` takes max_calls, max_cost, deadline_seconds.
        """
        body: dict[str, Any] = {
            "name": name,
            "key": key if key is not None else f"client-{uuid.uuid4()}",
        }
        if budget is not None:
            body["budget"] = budget
        response = self._request("POST", "/runs", json=body)
        return Run(self, _json(response), created=response.status_code == 201)

    def get_run(self, run_id: str) -> Run:
        return Run(self, _json(self._request("GET", f"/runs/{_segment(run_id)}")))

    def get_step(self, step_id: str) -> Step:
        return Step(self, self._get_step_raw(step_id))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Stepward:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- HTTP with retries --

    def _get_step_raw(
        self, step_id: str, *, wait: float = 0.0, version: int | None = None
    ) -> dict[str, Any]:
        params: dict[str, Any] = {}
        if wait > 0:
            params["wait"] = round(wait, 3)
        if version is not None:
            params["version"] = version
        raw: dict[str, Any] = _json(
            self._request("GET", f"/steps/{_segment(step_id)}", params=params, hold=wait)
        )
        return raw

    def _request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: dict[str, Any] | None = None,
        hold: float = 0.0,
    ) -> httpx.Response:
        """One API call with its retries; returns a 2xx answer or raises a StepwardError.

        `hold` is how long the server may hold the answer (a long poll): the read timeout
        is extended by it. The body is built once, so every retry sends the same key.
        """
        timeout = httpx.Timeout(self.timeout, read=self.timeout + hold)
        attempt = 0
        while True:
            attempt += 1
            try:
                response = self._http.request(
                    method, path, json=json, params=params, timeout=timeout
                )
            except (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError) as exc:
                if attempt > self.retries:
                    raise ConnectionFailed(
                        f"{method} {self.url}{path}: {exc!r} (after {attempt} attempts)",
                        attempts=attempt,
                    ) from exc
                delay = self._backoff_seconds(attempt)
            except httpx.TransportError as exc:
                # An unusable URL or a broken request: trying again cannot help.
                raise ConnectionFailed(
                    f"{method} {self.url}{path}: {exc!r}", attempts=attempt
                ) from exc
            else:
                if response.is_success:
                    return response
                error = error_from_response(response)
                if response.status_code not in RETRYABLE_STATUSES or attempt > self.retries:
                    raise error
                retry_after = _retry_after(response)
                if retry_after is None and isinstance(error, RateLimited):
                    retry_after = error.retry_after
                if retry_after is not None and retry_after > MAX_RETRY_AFTER_SECONDS:
                    raise error
                delay = self._backoff_seconds(attempt)
                if retry_after is not None:
                    # Not before the server said; the jitter spreads agents that were
                    # refused together.
                    delay = retry_after + random.uniform(0, self.backoff)
            time.sleep(delay)

    def _backoff_seconds(self, attempt: int) -> float:
        ceiling = min(MAX_BACKOFF_SECONDS, self.backoff * 2 ** (attempt - 1))
        return random.uniform(0, ceiling)
