"""The Tool contract (DESIGN.md §6) and the registry of tools by name.

A tool declares how the engine may treat it; the engine obeys. A tool whose declarations
are missing or contradictory cannot be registered.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import inspect
import json
import re
import threading
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from decimal import Decimal
from typing import Any, ClassVar

import jsonschema
from django.db import models
from jsonschema.protocols import Validator

from executor.common.redaction import Redactor, is_secret_key


class Effect(models.TextChoices):
    """What a call does to the world (DESIGN.md §6)."""

    PURE = "pure"
    READ = "read"
    WRITE = "write"
    DESTRUCTIVE = "destructive"


class Idempotency(models.TextChoices):
    NONE = "none"
    # Only when the external system verifiably deduplicates on a key we send.
    KEY = "key"


class ApprovalRule(models.TextChoices):
    ALWAYS = "always"
    NEVER = "never"
    # Destructive effects need a person.
    BY_POLICY = "by_policy"


@dataclass(frozen=True)
class ApprovalPolicy:
    """Whether a person approves each call of a tool (DESIGN.md §6, §9): `always`, `never`,
    or `by_policy` with these rules, each on by default: destructive effects and
    irreversible writes need a person, and so does a call estimated to cost more than
    `cost_above` (when set and the tool can estimate)."""

    rule: ApprovalRule
    destructive: bool = True
    irreversible: bool = True
    cost_above: Decimal | None = None

    def needs_person(self, tool: type[Tool] | Tool, input: dict[str, Any] | None) -> bool:
        if self.rule == ApprovalRule.ALWAYS:
            return True
        if self.rule == ApprovalRule.NEVER:
            return False
        if self.destructive and tool.effect == Effect.DESTRUCTIVE:
            return True
        if self.irreversible and tool.is_irreversible():
            return True
        if self.cost_above is not None:
            estimate = tool.estimated_cost(input)
            return estimate is not None and estimate > self.cost_above
        return False

    def encoded(self) -> str:
        """The policy as one short text (stored with a workspace's policy, hashed into its
        approvals' policy version)."""
        cost = "" if self.cost_above is None else format(self.cost_above, "f")
        return f"{self.rule}:{int(self.destructive)}:{int(self.irreversible)}:{cost}"

    @classmethod
    def decoded(cls, text: str) -> ApprovalPolicy:
        rule, destructive, irreversible, cost = text.split(":")
        return cls(
            rule=ApprovalRule(rule),
            destructive=destructive == "1",
            irreversible=irreversible == "1",
            cost_above=Decimal(cost) if cost else None,
        )


class FailureClass(enum.StrEnum):
    TRANSIENT = "transient"
    RATE_LIMITED = "rate_limited"
    UNAVAILABLE = "unavailable"
    AMBIGUOUS = "ambiguous"
    INVALID_INPUT = "invalid_input"
    PERMISSION_DENIED = "permission_denied"
    POLICY_DENIED = "policy_denied"
    CONFLICT = "conflict"
    DESTRUCTIVE_UNSAFE = "destructive_unsafe"


RETRYABLE = frozenset({FailureClass.TRANSIENT, FailureClass.RATE_LIMITED, FailureClass.UNAVAILABLE})


@dataclass(frozen=True)
class RetryPolicy:
    initial_interval: float = 1.0
    backoff_coefficient: float = 2.0
    max_interval: float = 60.0
    max_attempts: int = 5
    # Caps the whole operation, counted from first scheduling (seconds).
    deadline: float = 600.0

    def __post_init__(self) -> None:
        if not (self.initial_interval > 0 and self.max_interval >= self.initial_interval):
            raise ValueError("retry intervals must be positive, max_interval >= initial")
        if self.backoff_coefficient < 1:
            raise ValueError("backoff_coefficient must be at least 1")
        if self.max_attempts < 1 or self.deadline <= 0:
            raise ValueError("max_attempts and deadline must be positive")

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


class ToolError(Exception):
    """An error a tool raises with its class already known."""

    def __init__(
        self,
        failure_class: FailureClass,
        message: str,
        *,
        retry_after: float | None = None,
        evidence: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.failure_class = failure_class
        self.retry_after = retry_after
        self.evidence = evidence or {}


@dataclass
class Invocation:
    """What the engine hands a tool for one attempt."""

    step_id: str
    operation_id: str
    input: dict[str, Any]
    fence: int
    attempt: int
    # Idempotency key: the operation id, stable across retries and replays.
    idempotency_key: str


@dataclass
class ToolResult:
    result: Any
    external_id: str = ""
    evidence: dict[str, Any] = field(default_factory=dict)


class LookupOutcome(enum.StrEnum):
    FOUND = "found"
    NOT_FOUND = "not_found"
    CANNOT_TELL = "cannot_tell"


@dataclass
class Lookup:
    outcome: LookupOutcome
    external_id: str = ""
    result: Any = None
    evidence: dict[str, Any] = field(default_factory=dict)


class Tool:
    """Subclass, declare every class attribute below, implement `invoke`, and `register`."""

    name: ClassVar[str]
    description: ClassVar[str] = ""
    effect: ClassVar[Effect]
    idempotency: ClassVar[Idempotency]
    requires_approval: ClassVar[ApprovalRule]
    # Name of the tool that undoes this one; "" means irreversible.
    compensation: ClassVar[str]
    retry: ClassVar[RetryPolicy]
    # JSON Schema of the input object.
    input_schema: ClassVar[dict[str, Any]]
    # Input fields never shown, summarized or copied into evidence, at any nesting level;
    # besides them, every key that looks like a secret is redacted (executor/common/redaction.py).
    redact: ClassVar[frozenset[str]] = frozenset()
    _validator: ClassVar[Validator | None] = None
    # Only an authoritative lookup's `not_found` proves that nothing happened.
    lookup_authoritative: ClassVar[bool] = False
    # Whether invoke() checks the fence token it is given (DESIGN.md §7).
    accepts_fence: ClassVar[bool] = False
    # What the external ids of its effects look like (a regular expression the whole id
    # matches; "" accepts any): a person's "it happened" must name one of that form.
    external_id_pattern: ClassVar[str] = ""
    external_id_example: ClassVar[str] = ""
    # Limits across every worker (API.md "Slow tools"): calls in flight at once, and calls
    # started per period ("20/s", "600/m", "1000/h"); None and "" for none. A tool at its
    # limit leaves its steps pending. An admin may override both on the tool's row.
    max_in_flight: ClassVar[int | None] = None
    rate: ClassVar[str] = ""
    # Where the tool is defined: code ("code"), an HTTP tool's row ("http"), an MCP
    # upstream's listing ("upstream"). Of several that take one name, PRECEDENCE decides.
    defined_by: ClassVar[str] = "code"

    REQUIRED: ClassVar[tuple[str, ...]] = (
        "name",
        "effect",
        "idempotency",
        "requires_approval",
        "compensation",
        "retry",
        "input_schema",
    )

    # `invoke` may be `async def` (DESIGN.md §16): the worker then awaits it on its event
    # loop; a plain one runs on a thread of the worker's call pool, which never touches the
    # database. A tool with both (`ainvoke` beside a plain `invoke`, as the HTTP tools have)
    # is awaited in a worker and called plainly elsewhere.
    def invoke(self, call: Invocation) -> ToolResult:
        raise NotImplementedError

    # Tools with a lookup override this; `has_lookup` tells whether they did.
    def lookup(self, call: Invocation) -> Lookup:
        raise NotImplementedError

    @classmethod
    def has_lookup(cls) -> bool:
        return cls.lookup is not Tool.lookup

    def check_input(self, value: dict[str, Any]) -> list[str]:
        """What this deployment refuses in an input that fits the schema (e.g. a host not
        allow-listed), one message per refusal naming what is refused; empty when none.

        Called when a step is posted, after `validate_input`: a refusal is the agent's 422
        and nothing is stored. It judges the input against settings only, never by asking
        the external system. Settings may change between post and call, so `invoke` checks
        again (a `policy_denied` ToolError).
        """
        return []

    def classify(self, error: BaseException) -> FailureClass:
        """Maps an error to a failure class. The default trusts nothing it cannot name."""
        if isinstance(error, ToolError):
            return error.failure_class
        return FailureClass.AMBIGUOUS

    def cost(self, result: ToolResult) -> Decimal:
        return Decimal(0)

    def effects_counted(self, operation_ids: list[str]) -> dict[str, int] | None:
        """How many effects the external system itself counts per operation id, or None
        where it cannot say. Used to reconcile a run's usage against the other side."""
        return None

    def compensation_input(self, external_id: str, result: Any) -> dict[str, Any]:
        """The input of the compensating tool's step that undoes a completed call."""
        return {"external_id": external_id, "result": result}

    def compensation_input_for(
        self, input: dict[str, Any], external_id: str, result: Any
    ) -> dict[str, Any]:
        """The same, for a tool whose undo needs the call's own input too (an MCP upstream's
        tools are undone with the arguments they were called with)."""
        return self.compensation_input(external_id, result)

    # --- derived ------------------------------------------------------------------------

    @classmethod
    def needs_approval(cls, input: dict[str, Any] | None = None) -> bool:
        """Whether a person approves each call, by the tool's own declaration (a workspace
        may set its own: executor.policy.authorization.ApprovalPolicy)."""
        return ApprovalPolicy(rule=cls.requires_approval).needs_person(cls, input)

    @classmethod
    def external_id_fits(cls, external_id: str) -> bool:
        return not cls.external_id_pattern or bool(
            re.fullmatch(cls.external_id_pattern, external_id)
        )

    @classmethod
    def external_id_form(cls) -> str:
        """The expected form, as a person reads it."""
        if not cls.external_id_pattern:
            return "any text"
        example = f", e.g. {cls.external_id_example}" if cls.external_id_example else ""
        return f"an id matching {cls.external_id_pattern}{example}"

    @classmethod
    def is_irreversible(cls) -> bool:
        """A change to the world that nothing undoes: a write or destructive effect with no
        compensation."""
        return cls.effect in (Effect.WRITE, Effect.DESTRUCTIVE) and not cls.compensation

    @classmethod
    def estimated_cost(cls, input: dict[str, Any] | None) -> Decimal | None:
        """What a call with this input will probably cost, before it is made (None: not
        known); approval policies may ask a person above a threshold."""
        return None

    @classmethod
    def policy_version(cls) -> str:
        """A digest of every declaration: any change invalidates earlier approvals."""
        declared = {
            "effect": str(cls.effect),
            "idempotency": str(cls.idempotency),
            "requires_approval": str(cls.requires_approval),
            "compensation": cls.compensation,
            "retry": cls.retry.as_dict(),
            "input_schema": cls.input_schema,
            "redact": sorted(cls.redact),
            "lookup": cls.has_lookup(),
            "lookup_authoritative": cls.lookup_authoritative,
            **cls.declared_extra(),
        }
        return hashlib.sha256(json.dumps(declared, sort_keys=True).encode()).hexdigest()[:16]

    @classmethod
    def declared_extra(cls) -> dict[str, Any]:
        """Further declarations an approval is bound to (an HTTP tool's method, URL…)."""
        return {}

    @classmethod
    def request_details(cls) -> dict[str, Any]:
        """What, besides the tool and its redacted input, an attempt's request evidence says
        of where the call goes (an MCP upstream's name and how it is reached)."""
        return {}

    @classmethod
    def validator(cls) -> Validator:
        """The input schema's validator, built once per tool class: the draft its `$schema`
        names (an MCP server's may be draft-07), else 2020-12."""
        built = cls.__dict__.get("_validator")
        if built is None or built.schema is not cls.input_schema:
            built = validator_class(cls.input_schema)(cls.input_schema)
            cls._validator = built
        return built

    @classmethod
    def validate_input(cls, value: Any) -> list[str]:
        """Returns the input's schema errors, empty when it is valid."""
        found = sorted(cls.validator().iter_errors(value), key=lambda e: [str(p) for p in e.path])
        if not found:
            return []
        redactor = cls.redactor(value)
        errors = []
        for error in found:
            path = [str(p) for p in error.absolute_path]
            # jsonschema quotes the offending value: never echo a secret back.
            message = (
                f"does not fit the schema ({error.validator})"
                if any(is_secret_key(part, cls.redact) for part in path)
                else redactor.text(error.message)
            )
            errors.append(f"{'/'.join(path) or '(input)'}: {message}")
        return errors

    @classmethod
    def redactor(cls, value: Any) -> Redactor:
        """What must not be shown of a call with this input (DESIGN.md §15)."""
        return Redactor.for_input(value, cls.redact)

    @classmethod
    def redacted(cls, value: dict[str, Any]) -> dict[str, Any]:
        redacted: dict[str, Any] = cls.redactor(value)(value)
        return redacted

    @classmethod
    def summarize(cls, value: dict[str, Any], limit: int = 500) -> str:
        text = json.dumps(cls.redacted(value), sort_keys=True, ensure_ascii=False, default=str)
        return text if len(text) <= limit else text[: limit - 1] + "…"


class RegistrationError(Exception):
    pass


def validator_class(schema: Any) -> type[Validator]:
    """The validator of the draft `schema` names in `$schema`, else Draft 2020-12's."""
    found: type[Validator] = jsonschema.validators.validator_for(
        schema, default=jsonschema.Draft202012Validator
    )
    return found


_registry: dict[str, Tool] = {}


# --- per-tool limits (API.md "Slow tools"; the engine's accounting: executor/policy/tool_limits.py)

RATE_PATTERN = re.compile(r"\s*(\d+)\s*/\s*(s|sec|second|m|min|minute|h|hour)\s*")
PERIODS = {"s": 1, "sec": 1, "second": 1, "m": 60, "min": 60, "minute": 60}
PERIODS |= {"h": 3600, "hour": 3600}


@dataclass(frozen=True)
class Rate:
    calls: int
    seconds: int

    def __str__(self) -> str:
        unit = {1: "s", 60: "m", 3600: "h"}[self.seconds]
        return f"{self.calls}/{unit}"


def parse_rate(text: str) -> Rate | None:
    """`"20/s"`, `"600/m"`, `"1000/h"` as a Rate; None for ""; ValueError for anything else."""
    if not text:
        return None
    match = RATE_PATTERN.fullmatch(text)
    if not match or int(match.group(1)) < 1:
        raise ValueError(f"{text!r} is not a rate like 20/s, 600/m or 1000/h (at least 1)")
    return Rate(int(match.group(1)), PERIODS[match.group(2)])


def rate_problem(value: Any) -> str:
    """Why `value` cannot be a tool's `rate`; "" when it can."""
    if not isinstance(value, str):
        return "must be a string like 20/s, 600/m or 1000/h"
    try:
        parse_rate(value)
    except ValueError as error:
        return str(error)
    return ""


def max_in_flight_problem(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return "must be a whole number of calls, at least 1"
    return ""


def awaitable(tool: Tool) -> Callable[[Invocation], Awaitable[ToolResult]] | None:
    """The tool's call as a coroutine function where it has one (an `async def invoke`, or
    an `ainvoke` beside a plain one); None for a plain tool."""
    if inspect.iscoroutinefunction(tool.invoke):
        return tool.invoke
    native = getattr(tool, "ainvoke", None)
    return native if native is not None and inspect.iscoroutinefunction(native) else None


def invoke_blocking(tool: Tool, call: Invocation) -> ToolResult:
    """Calls the tool and waits for its answer, in a thread with no event loop running (an
    `async def invoke` is run to its end on a loop of its own)."""
    if inspect.iscoroutinefunction(tool.invoke):
        answer: ToolResult = asyncio.run(tool.invoke(call))
        return answer
    return tool.invoke(call)


def check_declarations(cls: type[Tool]) -> None:
    missing = [attr for attr in Tool.REQUIRED if not hasattr(cls, attr)]
    if missing:
        raise RegistrationError(f"tool {cls.__name__} does not declare {', '.join(missing)}")
    if cls.effect not in Effect.values or cls.idempotency not in Idempotency.values:
        raise RegistrationError(f"tool {cls.name}: unknown effect or idempotency")
    if cls.requires_approval not in ApprovalRule.values:
        raise RegistrationError(f"tool {cls.name}: unknown requires_approval")
    if not isinstance(cls.retry, RetryPolicy):
        raise RegistrationError(f"tool {cls.name}: retry must be a RetryPolicy")
    if cls.lookup_authoritative and not cls.has_lookup():
        raise RegistrationError(f"tool {cls.name}: an authoritative lookup needs a lookup()")
    if cls.invoke is Tool.invoke:
        raise RegistrationError(f"tool {cls.name} does not implement invoke()")
    if cls.max_in_flight is not None and max_in_flight_problem(cls.max_in_flight):
        raise RegistrationError(
            f"tool {cls.name}: max_in_flight {max_in_flight_problem(cls.max_in_flight)}"
        )
    if rate_problem(cls.rate) if cls.rate else False:
        raise RegistrationError(f"tool {cls.name}: rate: {rate_problem(cls.rate)}")
    try:
        validator_class(cls.input_schema).check_schema(cls.input_schema)
    except jsonschema.SchemaError as error:
        raise RegistrationError(f"tool {cls.name}: bad input_schema: {error.message}") from error
    if cls.input_schema.get("type") != "object":
        raise RegistrationError(f"tool {cls.name}: input_schema must describe an object")


_lock = threading.RLock()
# Where tools come from besides `@register` at import (HTTP tools defined as data): each
# is called before the registry is read, and refreshes its tools when they changed.
_sources: list[Callable[[], None]] = []


def register[T: type[Tool]](cls: T) -> T:
    check_declarations(cls)
    with _lock:
        if cls.name in _registry and type(_registry[cls.name]) is not cls:
            raise RegistrationError(f"a tool named {cls.name} is already registered")
        _registry[cls.name] = cls()
    return cls


def unregister(name: str) -> None:
    with _lock:
        _registry.pop(name, None)


# Which kind of tool keeps a name that several define (a tool of code, then an HTTP tool,
# then an MCP upstream's): fixed, whatever each process happened to load first.
PRECEDENCE = ("code", "http", "upstream")


def _rank(tool: type[Tool] | Tool) -> int:
    return PRECEDENCE.index(tool.defined_by)


def install(cls: type[Tool]) -> bool:
    """Registers a tool defined as data under its name, replacing in one step (a reader
    never finds the name empty) one of its own kind or of a kind that yields to it. False,
    and nothing changed, when the name is held by a kind that outranks it."""
    check_declarations(cls)
    with _lock:
        existing = _registry.get(cls.name)
        if existing is not None and _rank(existing) < _rank(cls):
            return False
        _registry[cls.name] = cls()
    return True


def uninstall(name: str, defined_by: str) -> None:
    """Unregisters `name` if a tool of that kind holds it (not one that took it over)."""
    with _lock:
        existing = _registry.get(name)
        if existing is not None and existing.defined_by == defined_by:
            del _registry[name]


def add_source(refresh: Callable[[], None]) -> None:
    """Registers a source of tools, asked to refresh them whenever the registry is read."""
    _sources.append(refresh)


def _refreshed() -> dict[str, Tool]:
    for refresh in _sources:
        refresh()
    return _registry


def registered(name: str) -> Tool | None:
    """The tool registered under `name` now, without asking the sources to refresh."""
    with _lock:
        return _registry.get(name)


def get_tool(name: str) -> Tool:
    try:
        return _refreshed()[name]
    except KeyError:
        raise LookupError(f"no tool named {name!r}") from None


def find_tool(name: str) -> Tool | None:
    """The registered tool, or None where this process does not know it (any more)."""
    try:
        return get_tool(name)
    except LookupError:
        return None


def all_tools() -> list[Tool]:
    registry = _refreshed()
    with _lock:
        return [registry[name] for name in sorted(registry)]
