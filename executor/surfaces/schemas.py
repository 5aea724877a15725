"""The agents' API request and response shapes (API.md); the OpenAPI schema is built from them."""

from __future__ import annotations

import re
from datetime import datetime
from decimal import Decimal
from typing import Annotated, Any, Literal, get_args
from uuid import UUID

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictInt,
    WithJsonSchema,
)

from executor.ledger.records import RunStatus
from executor.ledger.states import State

# Bounds the database can hold: PositiveIntegerField and DecimalField(14, 4).
MAX_INT = 2_147_483_647
MAX_DEADLINE_SECONDS = 366 * 24 * 3600
# Deeper input is refused: no tool needs it, and each layer costs stack in every reader.
MAX_INPUT_DEPTH = 64

StateName = Literal[
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
]
assert set(get_args(StateName)) == set(State.values), "StateName must list every State"

RunStatusName = Literal["open", "closed", "paused", "cancelled"]
assert set(get_args(RunStatusName)) == set(RunStatus.values), "RunStatusName must list every status"


def storable_text(value: str) -> str:
    # PostgreSQL refuses NUL in text and jsonb, and no database stores a lone surrogate:
    # refused here they are a 422, not a 500 at the INSERT.
    if "\x00" in value:
        raise ValueError("must not contain the NUL character")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode (it holds a lone surrogate)") from None
    return value


def storable_json(value: dict[str, Any]) -> dict[str, Any]:
    _check_json(value, depth=1)
    return value


def _check_json(value: Any, depth: int) -> None:
    if depth > MAX_INPUT_DEPTH:
        raise ValueError(f"is nested deeper than {MAX_INPUT_DEPTH} levels")
    if isinstance(value, str):
        storable_text(value)
    elif isinstance(value, dict):
        for key, item in value.items():
            storable_text(key)
            _check_json(item, depth + 1)
    elif isinstance(value, list):
        for item in value:
            _check_json(item, depth + 1)


# What the schema says of every text field; the validator also refuses lone surrogates,
# which no JSON Schema pattern can name.
NO_NUL = "^[^\\u0000]*$"
Text = Annotated[str, AfterValidator(storable_text), Field(json_schema_extra={"pattern": NO_NUL})]

# A cost as DecimalField(14, 4) holds it: up to 10 digits before the point, 4 after.
DECIMAL_TEXT = r"^[0-9]{1,10}(\.[0-9]{1,4})?$"


MAX_COST_NUMBER = 9_999_999_999.9999


def decimal_text(value: Any) -> Any:
    # A string must be a plain decimal: no exponent, sign, spaces or "NaN".
    if isinstance(value, str) and not re.fullmatch(DECIMAL_TEXT, value):
        raise ValueError('must be a decimal string like "12.5" (at most 4 decimal places)')
    return value


Cost = Annotated[
    Decimal,
    BeforeValidator(decimal_text),
    Field(ge=0, max_digits=14, decimal_places=4),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "string", "pattern": DECIMAL_TEXT, "examples": ["12.5"]},
                # Still taken, for the clients that send one, when it has at most 4 decimal
                # places: no JSON Schema keyword says that of a binary float (multipleOf
                # 0.0001 refuses 0.3), so the schema cannot promise it.
                {
                    "type": "number",
                    "minimum": 0,
                    "maximum": MAX_COST_NUMBER,
                    "deprecated": True,
                    "description": "Deprecated: send a decimal string. A number with more "
                    "than 4 decimal places is refused.",
                },
            ]
        }
    ),
]
StepKey = Annotated[Text, Field(min_length=1, max_length=200)]


class Schema(BaseModel):
    """The base of every body and answer: a plain pydantic model. The handlers build answers
    as dicts (`run_out`, `step_out`), so django-ninja's Schema, which can also read a Django
    object's attributes, would only add its wrapper around every object validated: a 500-step
    batch and its answer cost 20 ms more through it."""


class RequestSchema(Schema):
    # An unknown field is refused rather than ignored: a misspelt `depends_on` or `budget`
    # would otherwise run a step without the guard the agent asked for.
    model_config = ConfigDict(extra="forbid")


# --- requests ---------------------------------------------------------------------------


class BudgetIn(RequestSchema):
    max_calls: StrictInt | None = Field(
        None, ge=1, le=MAX_INT, description="Most tool calls (submissions) the run may make."
    )
    max_cost: Cost | None = Field(
        None,
        description='Most cost units the run may use: a decimal string such as "12.5", up to '
        "10 digits before the point and 4 after.",
    )
    deadline_seconds: float | None = Field(
        None,
        gt=0,
        le=MAX_DEADLINE_SECONDS,
        description="Seconds from creation after which the run starts nothing new.",
    )


class RunIn(RequestSchema):
    name: Text = Field(min_length=1, max_length=200)
    key: Text | None = Field(
        None,
        min_length=1,
        max_length=200,
        description="The caller's key: posting the same key again returns the existing run.",
    )
    budget: BudgetIn | None = None


class StepIn(RequestSchema):
    key: StepKey = Field(
        description="Unique within the run; posting it again with the same call is a no-op."
    )
    tool: Text = Field(min_length=1, max_length=100, description="A name from GET /tools.")
    input: Annotated[dict[str, Any], AfterValidator(storable_json)] = Field(
        description="A JSON object that fits the tool's input_schema."
    )
    summary: Text | None = Field(
        None,
        max_length=2000,
        description="Human-readable summary for reviewers; by default one is made from the "
        "input without its redacted fields.",
    )
    depends_on: list[StepKey] = Field(
        default_factory=list,
        max_length=1000,
        description="Keys of steps of this run that must complete before this one starts.",
    )


class StepsBatchIn(RequestSchema):
    steps: list[StepIn] = Field(
        min_length=1,
        # Said, not checked here: more than 500 is a 413 (the handler's), not a 422.
        json_schema_extra={"maxItems": 500},
        description="1 to 500 steps, posted all or nothing; `depends_on` may name earlier "
        "items. More than 500 answers 413.",
    )


class CancelIn(RequestSchema):
    reason: Text | None = Field(None, max_length=500)


# --- answers ----------------------------------------------------------------------------


class ErrorBody(Schema):
    code: str = Field(
        description="malformed_json, unauthorized, forbidden, not_found, method_not_allowed, "
        "conflict, body_too_large, invalid_body, rate_limited, ..."
    )
    message: str
    details: Any = None


class ErrorOut(Schema):
    error: ErrorBody


class RetryOut(Schema):
    initial_interval: float
    backoff_coefficient: float
    max_interval: float
    max_attempts: int
    deadline: float


class ToolOut(Schema):
    name: str
    description: str
    effect: Literal["pure", "read", "write", "destructive"]
    idempotency: Literal["none", "key"]
    has_lookup: bool
    compensation: str = Field(description='Name of the tool that undoes this one; "" if none.')
    requires_approval: bool = Field(
        description="Whether a step with this tool waits for a reviewer's approval "
        "(the declared rule, below, applied to the tool)."
    )
    approval_rule: Literal["always", "never", "by_policy"] = Field(
        description="The tool's declared rule; by_policy means destructive tools need approval."
    )
    retry: RetryOut
    input_schema: dict[str, Any] = Field(description="JSON Schema of the step's input.")
    usable: bool = Field(description="Whether this agent holds use_tool on it.")


class BudgetOut(Schema):
    max_calls: int | None
    max_cost: float | None
    deadline: datetime | None


class UsageOut(Schema):
    calls: int
    cost: float
    elapsed_seconds: float


class RunOut(Schema):
    id: UUID
    name: str
    key: str | None
    status: RunStatusName
    pause_reason: str
    budget: BudgetOut
    usage: UsageOut
    counts: dict[str, int] = Field(description="Number of steps in each state (absent: 0).")
    created_at: datetime


class FailureOut(Schema):
    model_config = ConfigDict(populate_by_name=True)

    class_: str = Field(alias="class", description="A failure class (DESIGN.md §8).")
    message: str


class StepOut(Schema):
    """A step as the agent sees it. Its raw input is never shown: it may hold secrets."""

    id: UUID
    run_id: UUID
    key: str
    tool: str
    state: StateName
    input_summary: str
    operation_id: UUID
    attempt_count: int
    external_id: str
    result: Any
    failure: FailureOut | None
    created_at: datetime
    updated_at: datetime
    version: int = Field(description="Grows by one on every change; see ?version= on GET.")
    position: int = Field(description="Posting order within the run; see ?after= on the list.")
    depends_on: list[str]
    compensates: UUID | None = Field(description="The step this one undoes, if any.")


class BatchStepOut(StepOut):
    created: bool = Field(description="Whether this post created the step (else it existed).")


class StepsBatchOut(Schema):
    steps: list[BatchStepOut] = Field(description="The batch's steps, in the request's order.")


class ReportEntryOut(Schema):
    step_id: UUID
    key: str
    tool: str
    state: StateName
    external_id: str
    evidence: dict[str, Any]


class ReportOut(Schema):
    completed: list[ReportEntryOut]
    uncertain: list[ReportEntryOut]
    failed: list[ReportEntryOut]
    compensated: list[ReportEntryOut]
    pending: list[ReportEntryOut]
    usage: dict[str, Any]
    summary: str
