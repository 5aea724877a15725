"""The agents' JSON API, `/api/v1/` (API.md): bearer-token auth, rate limit, error shape.

Handlers parse, call a service or selector, and shape the answer; the rules live in
`services` and `selectors`. An agent sees its workspace's runs and steps and nothing else:
another workspace's ids answer exactly like ids that do not exist.

Why one module of about 700 lines: one handler per operation of API.md, in its order,
with the authentication and error shape they share.
"""

from __future__ import annotations

import json
import math
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from datetime import timedelta
from typing import Annotated, Any, cast

from asgiref.sync import sync_to_async
from django import db
from django.conf import settings
from django.core.handlers.asgi import ASGIRequest
from django.db.models import QuerySet
from django.http import Http404, HttpRequest, HttpResponse
from django.utils import timezone
from ninja import NinjaAPI, Path, Query, Status
from ninja.errors import AuthenticationError, HttpError, Throttled, ValidationError
from ninja.parser import Parser
from ninja.security import HttpBearer
from ninja.throttling import AuthRateThrottle
from ninja.types import DictStrAny

from executor.common import logcontext
from executor.common.redaction import redact
from executor.ledger import selectors
from executor.ledger.records import Agent, Run, Step, hash_token
from executor.services import posting, runs
from executor.services.base import Conflict, Invalid, NotPermitted, ServiceError
from executor.services.posting import MAX_BATCH, StepRequest, steps_post
from executor.surfaces import limits, waits
from executor.surfaces.http import ERROR_CODES, error_response
from executor.surfaces.schemas import (
    MAX_INT,
    BudgetIn,
    CancelIn,
    ErrorOut,
    ReportOut,
    RunIn,
    RunOut,
    StepIn,
    StepOut,
    StepsBatchIn,
    StepsBatchOut,
    ToolOut,
)

# Writing `last_seen_at` on every request would turn every read into a write.
LAST_SEEN_EVERY = timedelta(minutes=1)
STEPS_PAGE_MAX = 1000


# --- authentication and rate limit -------------------------------------------------------


class AgentToken(HttpBearer):
    """`Authorization: Bearer <token>`: an active agent whose token hashes to a stored hash.

    Requests whose token is missing or unknown are counted per client address; past
    `settings.API_BAD_TOKEN_RATE` they answer 429 instead of 401. A valid token is never
    refused by that count, even from an address over it: agents often share an address (one
    host, a NAT, a proxy), and one agent's stale token, or anyone sending junk from there,
    must not lock the others out. Guessing is no way in anyway (a token holds 256 random
    bits); the count makes a client stuck on a bad token back off (Retry-After).
    """

    def __call__(self, request: HttpRequest) -> Agent | None:
        agent = super().__call__(request)
        if agent is None:
            refuse_if_too_many_bad_tokens(request)
        return cast(Agent | None, agent)

    def authenticate(self, request: HttpRequest, token: str) -> Agent | None:
        return agent_for_token(token)


def agent_for_token(token: str) -> Agent | None:
    """The active agent whose token this is, or None; every surface an agent uses (the API,
    MCP over HTTP and stdio) authenticates through here."""
    token = token.strip()
    if not token:
        return None
    agent = selectors.agent_by_token_hash(hash_token(token))
    if agent is None:
        return None
    logcontext.add(agent=agent.name, workspace=agent.workspace.slug)
    now = timezone.now()
    if agent.last_seen_at is None or now - agent.last_seen_at >= LAST_SEEN_EVERY:
        Agent.objects.filter(pk=agent.pk).update(last_seen_at=now)
        agent.last_seen_at = now
    return agent


class Refused(Throttled):
    """A 429 with its own message and details (ninja's Throttled says only "too many")."""

    def __init__(self, wait: float, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(wait=math.ceil(max(1.0, wait)))
        self.message = message
        self.details = details or {}


BAD_TOKENS = limits.WindowLimit("bad_tokens")
LONG_POLLS = limits.ConcurrencyLimit("waits")
# A long-poll's slot outlives its wait by this much at most: the reads around the wait.
LONG_POLL_GRACE_SECONDS = 30


def client_address(request: HttpRequest) -> str:
    """The peer's address, or, with API_CLIENT_ADDRESS_HEADER set, the last entry of that
    header: the one written by the proxy in front of Stepward (entries before it are the
    client's own word)."""
    header = settings.API_CLIENT_ADDRESS_HEADER
    if header:
        entries = [entry.strip() for entry in request.headers.get(header, "").split(",")]
        entries = [entry for entry in entries if entry]
        if entries:
            return entries[-1]
    return str(request.META.get("REMOTE_ADDR") or "unknown")


def refuse_if_too_many_bad_tokens(request: HttpRequest) -> None:
    rate = limits.parse_rate(settings.API_BAD_TOKEN_RATE)
    if rate is None:
        return
    count, period = rate
    address = client_address(request)
    wait = BAD_TOKENS.hit(limits.cache_safe(address), count=count, period=period)
    if wait is not None:
        raise Refused(
            wait,
            "too many requests without a valid token from this address",
            {"limit": settings.API_BAD_TOKEN_RATE},
        )


def _long_poll_holder(agent: Agent) -> str:
    # With the token's hash, like the rate limit: a recycled primary key starts afresh.
    return f"{agent.pk}_{agent.token_hash[:16]}"


def long_polls_held(agent: Agent) -> int:
    """How many long-polls the agent holds now (in this cache: all web processes with
    CACHE_URL set)."""
    return LONG_POLLS.held(_long_poll_holder(agent), limit=settings.API_MAX_WAITS_PER_AGENT)


class ProcessWaits:
    """The long-polls this web process holds, at most API_MAX_WAITS_PER_PROCESS under WSGI
    (each holds one of the process's request threads while it waits, and the cap keeps the
    others for everyone else's requests, whoever holds the waits), or
    API_MAX_WAITS_PER_EVENT_LOOP under ASGI (a wait holds no thread there)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ends: dict[int, float] = {}
        self._next = 0

    def take(self, seconds: float, *, limit: int) -> int | None:
        with self._lock:
            if len(self._ends) >= limit:
                return None
            self._next += 1
            self._ends[self._next] = time.monotonic() + seconds
            return self._next

    def give_back(self, ticket: int) -> None:
        with self._lock:
            self._ends.pop(ticket, None)

    def held(self) -> int:
        with self._lock:
            return len(self._ends)

    def seconds_until_free(self) -> float:
        with self._lock:
            return max(0.0, min(self._ends.values(), default=0.0) - time.monotonic())


PROCESS_WAITS = ProcessWaits()
# Every agent's waits together, in the cache (all web processes, with CACHE_URL set).
ALL_WAITS_HOLDER = "all"


@contextmanager
def long_poll_slot(agent: Agent, seconds: float, *, on_loop: bool = False) -> Iterator[None]:
    """Holds, while the block runs, one of the agent's API_MAX_WAITS_PER_AGENT long-poll
    slots, one of every agent's API_MAX_WAITS, and one of this process's
    API_MAX_WAITS_PER_PROCESS (API_MAX_WAITS_PER_EVENT_LOOP `on_loop`, under ASGI); or
    refuses with 429 and Retry-After, saying which limit was reached: under WSGI each wait
    holds a web thread, and no one agent, nor all of them, may hold the threads everyone
    else's requests need; on an event loop a wait holds no thread, and the caps bound what
    one client can make the server keep."""
    limit = settings.API_MAX_WAITS_PER_AGENT
    holder = _long_poll_holder(agent)
    ttl = seconds + LONG_POLL_GRACE_SECONDS
    slot = LONG_POLLS.acquire(holder, limit=limit, hold_seconds=seconds, ttl=ttl)
    if slot is None:
        held = (
            f"this agent already holds {limit} long-polls (?wait=); wait for one to end"
            if limit
            else "long-polls (?wait=) are turned off here"
        )
        raise Refused(
            LONG_POLLS.seconds_until_free(holder, limit=limit),
            f"{held}, or read the step without ?wait=",
            {"limit": limit},
        )
    taken: list[Callable[[], None]] = [lambda: LONG_POLLS.release(slot)]
    try:
        everyone = settings.API_MAX_WAITS
        shared = LONG_POLLS.acquire(ALL_WAITS_HOLDER, limit=everyone, hold_seconds=seconds, ttl=ttl)
        if shared is None:
            raise Refused(
                LONG_POLLS.seconds_until_free(ALL_WAITS_HOLDER, limit=everyone),
                f"the server holds as many long-polls (?wait=) as it allows ({everyone}, "
                "for every agent together): try again later, or read the step without ?wait=",
                {"limit": everyone, "scope": "server"},
            )
        taken.append(lambda: LONG_POLLS.release(shared))
        here = (
            settings.API_MAX_WAITS_PER_EVENT_LOOP if on_loop else settings.API_MAX_WAITS_PER_PROCESS
        )
        ticket = PROCESS_WAITS.take(seconds, limit=here)
        if ticket is None:
            raise Refused(
                PROCESS_WAITS.seconds_until_free(),
                f"this web process holds as many long-polls (?wait=) as it allows ({here}): "
                "try again later, or read the step without ?wait=",
                {"limit": here, "scope": "process"},
            )
        taken.append(lambda: PROCESS_WAITS.give_back(ticket))
        yield
    finally:
        for give_back in reversed(taken):
            give_back()


class AgentRateThrottle(AuthRateThrottle):
    """At most `settings.API_RATE_LIMIT` requests per agent (e.g. "1200/min").

    The rate is read on every request, so a deployment or a test can change the setting
    without rebuilding the API. History lives in Django's cache: a shared cache (CACHE_URL)
    makes the limit hold across web processes; two racing requests may both be counted as
    the last one allowed, which only makes the limit approximate by a request or two.
    """

    def __init__(self) -> None:
        # ninja's throttles keep the request being checked on the instance, and one instance
        # serves every thread: what `wait()` needs is kept per thread instead.
        self._checked = threading.local()

    def get_cache_key(self, request: HttpRequest) -> str:
        agent = getattr(request, "auth", None)
        if not isinstance(agent, Agent):
            return super().get_cache_key(request)
        # With the token's hash: a rotated token starts afresh, and a recycled primary key
        # (SQLite reuses them) never inherits another agent's history.
        return f"stepward_api_rate_{agent.pk}_{agent.token_hash[:16]}"

    def allow_request(self, request: HttpRequest) -> bool:
        limit, period = self.parse_rate(settings.API_RATE_LIMIT)
        if limit is None or period is None:
            return True
        key = self.get_cache_key(request)
        now = time.time()
        history = [t for t in self.cache.get(key, []) if t > now - period]
        if len(history) >= limit:
            # The oldest request in the window leaves it first.
            self._checked.retry_after = history[-1] + period - now
            return False
        history.insert(0, now)
        self.cache.set(key, history, period)
        return True

    def wait(self) -> float | None:
        return max(1.0, getattr(self._checked, "retry_after", 1.0))


# --- the request body ----------------------------------------------------------------------


class MalformedJson(ValueError):
    """The body is not JSON at all: 400."""


class UnusableJson(ValueError):
    """The body is JSON the ledger cannot store faithfully: 422."""


def _refuse_constant(name: str) -> Any:
    raise MalformedJson(f"{name} is not a JSON value")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise UnusableJson(f"the number {text[:40]} is too large to store")
    return value


class StrictJsonParser(Parser):
    """JSON as RFC 8259 has it: no NaN or Infinity, and no number a database cannot hold."""

    def parse_body(self, request: HttpRequest) -> DictStrAny:
        try:
            value = json.loads(
                request.body, parse_constant=_refuse_constant, parse_float=_finite_float
            )
        except (MalformedJson, UnusableJson):
            raise
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise MalformedJson(str(error)) from error
        except RecursionError:
            raise UnusableJson("the body is nested too deeply") from None
        except ValueError as error:
            # Python refuses integers of more than 4300 digits.
            raise UnusableJson(str(error)) from error
        return cast(DictStrAny, value)


# --- the API and its errors ----------------------------------------------------------------

api = NinjaAPI(
    title="Stepward",
    version="1",
    description=(
        "The agents' API of Stepward, a durable step ledger: create runs, post the steps you "
        "want done, read their outcomes, cancel. Authenticate with `Authorization: Bearer "
        "<token>`. Every error answers `{error: {code, message, details}}`."
    ),
    urls_namespace="api",
    auth=AgentToken(),
    throttle=[AgentRateThrottle()],
    parser=StrictJsonParser(),
)


def errors(*statuses: int) -> dict[int, type[ErrorOut]]:
    """The error answers an operation can give, for its OpenAPI description: 401 and 429
    (the per-agent rate, bad tokens per address) for every one, and `statuses`."""
    return dict.fromkeys(sorted({401, 429, *statuses}), ErrorOut)


# What any operation with a JSON body may answer before its handler runs: 400 (not JSON, or
# a Content-Length that is not a number), 411 (a chunked body on a server that cannot read
# one), 413 (over the size limit), 422 (does not fit the schema).
BODY_ERRORS = (400, 411, 413, 422)
# An operation with query parameters answers 422 for a value that does not fit them.
QUERY_ERRORS = (422,)


@api.exception_handler(ValidationError)
def on_validation_error(request: HttpRequest, exc: ValidationError) -> HttpResponse:
    details = [
        {
            "loc": _public_loc(error.get("loc", ())),
            "msg": error.get("msg", ""),
            "type": error.get("type"),
        }
        for error in exc.errors
    ]
    return error_response(422, "invalid_body", "the request does not fit the schema", details)


def _public_loc(loc: Any) -> list[Any]:
    # ninja names the handler's parameter ("body", "payload", "name"); the client only
    # knows the body's own fields.
    parts = list(loc)
    if parts[:2] == ["body", "payload"]:
        del parts[1]
    return parts


@api.exception_handler(AuthenticationError)
def on_authentication_error(request: HttpRequest, exc: AuthenticationError) -> HttpResponse:
    response = error_response(401, "unauthorized", "a valid bearer token is required")
    response["WWW-Authenticate"] = 'Bearer realm="stepward"'
    return response


@api.exception_handler(Throttled)
def on_throttled(request: HttpRequest, exc: Throttled) -> HttpResponse:
    retry_after = math.ceil(exc.wait) if exc.wait else 1
    message, details = "too many requests", {}
    if isinstance(exc, Refused):
        message, details = exc.message, exc.details
    response = error_response(
        429, "rate_limited", message, {"retry_after_seconds": retry_after, **details}
    )
    response["Retry-After"] = str(retry_after)
    return response


@api.exception_handler(HttpError)
def on_http_error(request: HttpRequest, exc: HttpError) -> HttpResponse:
    # ninja wraps whatever the parser raised in a 400 HttpError; the cause says which.
    cause = exc.__cause__
    if isinstance(cause, MalformedJson):
        return error_response(
            400, "malformed_json", "the request body is not valid JSON", {"reason": str(cause)}
        )
    if isinstance(cause, UnusableJson):
        return error_response(422, "invalid_body", str(cause))
    status = exc.status_code
    return error_response(status, ERROR_CODES.get(status, "error"), exc.message)


@api.exception_handler(Http404)
def on_not_found(request: HttpRequest, exc: Http404) -> HttpResponse:
    return error_response(404, "not_found", "not found")


SERVICE_ERROR_STATUS: dict[type[ServiceError], int] = {
    NotPermitted: 403,
    Conflict: 409,
    Invalid: 422,
}


@api.exception_handler(ServiceError)
def on_service_error(request: HttpRequest, exc: ServiceError) -> HttpResponse:
    status = next((code for cls, code in SERVICE_ERROR_STATUS.items() if isinstance(exc, cls)), 400)
    return error_response(status, exc.code, exc.message, exc.details)


# --- lookups and shapes -------------------------------------------------------------------


def _agent(request: HttpRequest) -> Agent:
    agent = getattr(request, "auth", None)
    assert isinstance(agent, Agent), "every operation authenticates an agent"
    return agent


def _parse_id(value: str) -> uuid.UUID | None:
    try:
        return uuid.UUID(value)
    except ValueError:
        return None


def _run_or_404(agent: Agent, run_id: str) -> Run:
    pk = _parse_id(run_id)
    run = selectors.run_for_agent(agent=agent, run_id=pk) if pk else None
    if run is None:
        raise HttpError(404, "no such run")
    logcontext.add(run_id=run.pk)
    return run


def _visible_steps(agent: Agent) -> QuerySet[Step]:
    # The raw input may hold secrets the answer must never show: it is not even loaded.
    return selectors.steps_for_agent(agent=agent).defer("input")


def _step_or_404(agent: Agent, step_id: str) -> Step:
    pk = _parse_id(step_id)
    step = _visible_steps(agent).filter(pk=pk).first() if pk else None
    if step is None:
        raise HttpError(404, "no such step")
    logcontext.add(step_id=step.pk, run_id=step.run_id)
    return step


def run_out(run: Run) -> dict[str, Any]:
    return {
        "id": run.pk,
        "name": run.name,
        "key": run.key,
        "status": run.status,
        "pause_reason": run.pause_reason,
        "budget": selectors.run_budget(run=run),
        "usage": selectors.run_usage(run=run),
        "counts": selectors.run_counts(run=run),
        "created_at": run.created_at,
    }


def step_out(step: Step) -> dict[str, Any]:
    return {
        "id": step.pk,
        "run_id": step.run_id,
        "key": step.key,
        "tool": step.tool_id,
        "state": step.state,
        "input_summary": step.input_summary,
        "operation_id": step.operation_id,
        "attempt_count": step.attempt_count,
        "external_id": step.external_id,
        # Stored redacted; redacted again here for anything written before that (§15).
        "result": redact(step.result),
        "failure": step.failure,
        "created_at": step.created_at,
        "updated_at": step.updated_at,
        "version": step.version,
        "position": step.position,
        "depends_on": list(step.depends_on),
        "compensates": step.compensates_id,
    }


# Ids are taken as text and parsed by the handler: a malformed id is then a 404 like any
# other unknown id, not a validation error that tells ids from non-ids.
RunId = Annotated[str, Path(description="The run's id (a UUID).")]
StepId = Annotated[str, Path(description="The step's id (a UUID).")]


# --- operations -----------------------------------------------------------------------------


@api.get(
    "/tools",
    response={200: list[ToolOut], **errors()},
    operation_id="tools_list",
    summary="The registered tools and how the engine treats them",
)
def tools_list(request: HttpRequest) -> list[dict[str, Any]]:
    agent = _agent(request)
    return [
        {
            "name": info.name,
            "description": info.description,
            "effect": info.effect,
            "idempotency": info.idempotency,
            "has_lookup": info.has_lookup,
            "compensation": info.compensation,
            "requires_approval": info.needs_approval,
            "approval_rule": info.approval_rule,
            "retry": info.retry,
            "input_schema": info.input_schema,
            "usable": info.usable,
        }
        for info in selectors.tool_infos(workspace_id=agent.workspace_id, user_id=agent.user_id)
    ]


@api.post(
    "/runs",
    response={200: RunOut, 201: RunOut, **errors(*BODY_ERRORS, 403, 409)},
    operation_id="run_create",
    summary="Create a run (201), or get the run already created with this key (200)",
)
def run_create(request: HttpRequest, payload: RunIn) -> Status[dict[str, Any]]:
    agent = _agent(request)
    budget = payload.budget or BudgetIn.model_validate({})
    run, created = runs.run_create(
        agent=agent,
        name=payload.name,
        key=payload.key,
        max_calls=budget.max_calls,
        max_cost=budget.max_cost,
        deadline_seconds=budget.deadline_seconds,
    )
    return Status(201 if created else 200, run_out(run))


@api.get(
    "/runs/{run_id}",
    response={200: RunOut, **errors(404)},
    operation_id="run_get",
    summary="A run: status, budget, usage and how many steps are in each state",
)
def run_get(request: HttpRequest, run_id: RunId) -> dict[str, Any]:
    return run_out(_run_or_404(_agent(request), run_id))


@api.post(
    "/runs/{run_id}/steps",
    response={200: StepOut, 201: StepOut, **errors(*BODY_ERRORS, 403, 404, 409)},
    operation_id="step_post",
    summary="Post a step (201); the same key and call again answers the existing step (200)",
    description=(
        "A step with the same key but another call (tool, input or depends_on) is a 409. "
        "An unknown tool, or input that does not fit the tool's input_schema, is a 422."
    ),
    by_alias=True,
)
def step_post(request: HttpRequest, payload: StepIn, run_id: RunId) -> Status[dict[str, Any]]:
    agent = _agent(request)
    run = _run_or_404(agent, run_id)
    step, created = posting.step_post(
        agent=agent,
        run=run,
        key=payload.key,
        tool_name=payload.tool,
        input=payload.input,
        summary=payload.summary,
        depends_on=payload.depends_on,
    )
    return Status(201 if created else 200, step_out(step))


@api.post(
    "/runs/{run_id}/steps/batch",
    response={200: StepsBatchOut, 201: StepsBatchOut, **errors(*BODY_ERRORS, 403, 404, 409)},
    operation_id="steps_post_batch",
    summary="Post up to 500 steps at once, all or nothing (201 when any was created)",
    description=(
        "Each item is idempotent by key exactly like a single post; `depends_on` may name "
        "earlier items of the batch. One invalid or conflicting item refuses the whole batch "
        "(422 or 409, `details.index` names the item) and nothing is written. More than 500 "
        "items, or a body over API_MAX_BATCH_BODY_BYTES, answer 413."
    ),
    by_alias=True,
)
def steps_post_batch(
    request: HttpRequest, payload: StepsBatchIn, run_id: RunId
) -> Status[dict[str, Any]]:
    agent = _agent(request)
    if len(payload.steps) > MAX_BATCH:
        raise HttpError(413, f"a batch holds at most {MAX_BATCH} steps")
    run = _run_or_404(agent, run_id)
    steps, created = steps_post(
        agent=agent,
        run=run,
        requests=[
            StepRequest(
                key=item.key,
                tool=item.tool,
                input=item.input,
                summary=item.summary,
                depends_on=tuple(item.depends_on),
            )
            for item in payload.steps
        ],
    )
    answer = [
        {**step_out(step), "created": made} for step, made in zip(steps, created, strict=True)
    ]
    return Status(201 if any(created) else 200, {"steps": answer})


@api.get(
    "/runs/{run_id}/steps",
    response={200: list[StepOut], **errors(404, *QUERY_ERRORS)},
    operation_id="run_steps",
    summary="The run's steps in posting order",
    description=(
        "At most `limit` steps (default and maximum 1000) with a position after `after`. "
        "For the next page pass the last step's `position` as `after`; a page shorter than "
        "`limit` is the last."
    ),
    by_alias=True,
)
def run_steps(
    request: HttpRequest,
    run_id: RunId,
    limit: int = Query(STEPS_PAGE_MAX, ge=1, le=STEPS_PAGE_MAX),
    after: int = Query(0, ge=0, le=MAX_INT, description="Only steps with a later position."),
) -> list[dict[str, Any]]:
    agent = _agent(request)
    run = _run_or_404(agent, run_id)
    steps = _visible_steps(agent).filter(run=run, position__gt=after).order_by("position")
    return [step_out(step) for step in steps[:limit]]


@api.get(
    "/steps/{step_id}",
    response={200: StepOut, **errors(404, *QUERY_ERRORS)},
    operation_id="step_get",
    summary="A step; with ?wait=N, held until it changes or N seconds pass",
    description=(
        "`wait` (seconds, 0 to 30) holds the answer until the step's `version` changes, "
        "then answers the step as it is. To miss no change between two reads, pass the "
        "`version` you last saw: the answer comes at once if the step has moved on since. "
        "An agent holds at most API_MAX_WAITS_PER_AGENT waits at once (default 2), every "
        "agent together API_MAX_WAITS (1000), and one web process "
        "API_MAX_WAITS_PER_EVENT_LOOP (500) under ASGI or API_MAX_WAITS_PER_PROCESS (4) "
        "under WSGI: one more answers 429 with Retry-After, its `details.scope` saying "
        "which (absent: the agent's own)."
    ),
    by_alias=True,
)
async def step_get(
    request: HttpRequest,
    step_id: StepId,
    wait: float = Query(
        0,
        ge=0,
        le=settings.API_MAX_WAIT_SECONDS,
        description="Seconds to hold the answer until the step changes.",
    ),
    version: int | None = Query(
        None, ge=1, le=MAX_INT, description="Wait until the version differs from this one."
    ),
) -> dict[str, Any]:
    # Async: under an ASGI server a wait holds no thread and no database connection
    # (executor/surfaces/waits.py); under WSGI it holds the request's thread, as any request does.
    agent = _agent(request)
    on_loop = isinstance(request, ASGIRequest)
    step = await sync_to_async(_step_or_404)(agent, step_id)
    seen = step.version if version is None else version
    if wait > 0 and step.version == seen:
        slot = long_poll_slot(agent, wait, on_loop=on_loop)
        # The slot's counts are in the cache (Redis with CACHE_URL): read off the loop.
        await sync_to_async(_enter_waiting)(slot, on_loop)
        try:
            await waits.until_changed(step.pk, seen, wait)
        finally:
            await sync_to_async(slot.__exit__)(None, None, None)
        step = await sync_to_async(_step_or_404)(agent, step_id)
    return step_out(step)


def _enter_waiting(slot: AbstractContextManager[None], on_loop: bool) -> None:
    slot.__enter__()  # or Refused: 429
    if on_loop:
        # The request's thread gives its connection back while the wait holds nothing.
        db.connection.close()


@api.post(
    "/runs/{run_id}/cancel",
    response={200: RunOut, **errors(*BODY_ERRORS, 403, 404, 409)},
    operation_id="run_cancel",
    summary="Cancel the run: steps not yet submitted are cancelled; in-flight ones finish",
    description=(
        "Needs submit_steps on the workspace (403 otherwise); any run of the workspace may "
        "be cancelled. Cancelling a cancelled run again answers it as it is; a closed run "
        "is a 409."
    ),
)
def run_cancel(
    request: HttpRequest, run_id: RunId, payload: CancelIn | None = None
) -> dict[str, Any]:
    agent = _agent(request)
    run = _run_or_404(agent, run_id)
    reason = (payload.reason if payload else None) or ""
    run = runs.run_cancel(run=run, actor=agent, reason=reason)
    return run_out(run)


@api.get(
    "/runs/{run_id}/report",
    response={200: ReportOut, **errors(404, *QUERY_ERRORS)},
    operation_id="run_report",
    summary="What the run did: completed (with evidence), uncertain, failed, compensated",
)
def run_report(request: HttpRequest, run_id: RunId, reconcile: bool = False) -> dict[str, Any]:
    """`?reconcile=true` also asks each tool's external system for its own count of the
    run's effects (`usage.external`)."""
    return selectors.run_report(run=_run_or_404(_agent(request), run_id), external=reconcile)
