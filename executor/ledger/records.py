"""The ledger's records (DESIGN.md §3). The database holds every rule it can.

Why one module of about 700 lines: the records refer to each other and their constraints
are read together; the tool contract's vocabulary they use lives in `executor.tools`.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import struct
import time
import uuid
from collections.abc import Iterable, Sequence
from datetime import datetime
from decimal import Decimal
from typing import Any

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import MinValueValidator
from django.db import models
from django.db.models import Q
from django.utils import timezone
from guardian.models import GroupObjectPermissionBase, UserObjectPermissionBase

from executor.common.conditions import ConditionError, compile_condition

# The tool contract's vocabulary: the Tool table mirrors what tools declare.
from executor.contract.tool import ApprovalPolicy, ApprovalRule, Effect, Idempotency, rate_problem
from executor.ledger.states import LEASED, State

# Integers beyond this are compared as the floats JSON stores them as (jsonb normalizes).
EXACT_INTEGERS = 2**53


def comparable(value: Any) -> Any:
    """`value` in the form it has however a database stored and returned it, for hashing:
    PostgreSQL's jsonb gives 1.0 back as 1.0, but 1e100 as a 101-digit integer."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):
        return value if abs(value) <= EXACT_INTEGERS else repr(float(value))
    if isinstance(value, float):
        if value.is_integer() and abs(value) <= EXACT_INTEGERS:
            return int(value)
        return repr(value)
    if isinstance(value, dict):
        return {str(k): comparable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [comparable(v) for v in value]
    return str(value)


def canonical_hash(value: Any) -> str:
    """SHA-256 of `value`'s canonical JSON (sorted keys, numbers as stored)."""
    return hashlib.sha256(_CANONICAL.encode(comparable(value)).encode()).hexdigest()


# Made once: `json.dumps` with options builds an encoder at every call (posts hash each call).
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)


class DigestField(models.CharField):
    """A SHA-256 digest: its 64 hex characters in Python, its 32 bytes (`bytea`) on
    PostgreSQL, the hex text elsewhere (SQLite). The chain's digests are three a move and one
    a step, so on PostgreSQL this saves about 100 bytes an event (issue 25).

    An empty value (a chain's first `prev_hash`) is empty bytes. On PostgreSQL a value that
    is not hex is refused (ValueError) before it reaches the database; the ledger writes only
    digests it computed.
    """

    description = "A SHA-256 digest (hex in Python, bytes on PostgreSQL)"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("max_length", 64)
        super().__init__(*args, **kwargs)

    def db_type(self, connection: Any) -> str | None:
        if connection.vendor == "postgresql":
            return "bytea"
        return super().db_type(connection)

    def get_db_prep_value(self, value: Any, connection: Any, prepared: bool = False) -> Any:
        value = super().get_db_prep_value(value, connection, prepared)
        if connection.vendor == "postgresql" and isinstance(value, str):
            return bytes.fromhex(value)
        return value

    def from_db_value(self, value: Any, expression: Any, connection: Any) -> Any:
        if isinstance(value, bytes | memoryview):
            return bytes(value).hex()
        return value


def time_ordered_uuid() -> uuid.UUID:
    """A UUIDv7 (RFC 9562): 48 bits of Unix milliseconds, then 74 random bits.

    A step's id: steps posted together sort together, so the steps' key takes new entries at
    its right edge, and the rows a drain touches together (steps posted together, their
    events and attempts) sit on neighbouring index pages rather than on a random page each:
    the cache a million-step ledger needs. (It saves no bytes: an event after a step's first
    still lands inside the (step, seq) index.) It still cannot be guessed from another.
    """
    value = (time.time_ns() // 1_000_000 & (1 << 48) - 1) << 80 | secrets.randbits(80)
    value = value & ~(0xF << 76) | 0x7 << 76  # version 7
    value = value & ~(0x3 << 62) | 0x2 << 62  # the RFC's variant
    return uuid.UUID(int=value)


def call_hash(tool: str, input: Any) -> str:
    """What identifies a call: its tool and its input (a step's `input_hash`)."""
    return canonical_hash({"tool": tool, "input": input})


WORKSPACE_PERMISSIONS = (
    ("submit_steps", "Submit steps (agents)"),
    ("review_steps", "Review steps and probe unknown outcomes"),
    ("resolve_unknown", "Resolve unknown outcomes by hand"),
    ("approve_steps", "Approve or reject planned steps"),
    ("approve_compensation", "Approve compensations"),
    ("replay_deadletter", "Replay dead letters"),
    ("extend_budget", "Extend run budgets"),
)
REVIEWER_PERMISSIONS = tuple(code for code, _ in WORKSPACE_PERMISSIONS if code != "submit_steps")
AGENT_WORKSPACE_PERMISSIONS = ("submit_steps",)


class Workspace(models.Model):
    slug = models.SlugField(unique=True)
    name = models.CharField(max_length=200)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["slug"]
        permissions = WORKSPACE_PERMISSIONS

    def __str__(self) -> str:
        return self.slug


class WorkspaceUserObjectPermission(UserObjectPermissionBase):
    content_object = models.ForeignKey(Workspace, on_delete=models.CASCADE)


class WorkspaceGroupObjectPermission(GroupObjectPermissionBase):
    content_object = models.ForeignKey(Workspace, on_delete=models.CASCADE)


def validate_rate(value: str) -> None:
    """A rate like 20/s, 600/m or 1000/h (executor/policy/tool_limits.py), or empty."""
    problem = rate_problem(value) if value else ""
    if problem:
        raise ValidationError(problem)


class Tool(models.Model):
    """The database mirror of a registered tool, so guardian can grant `use_tool` on it."""

    name = models.CharField(max_length=100, unique=True)
    effect = models.CharField(max_length=20, choices=Effect.choices)
    idempotency = models.CharField(max_length=10, choices=Idempotency.choices)
    requires_approval = models.CharField(max_length=20, choices=ApprovalRule.choices)
    compensation = models.CharField(max_length=100, blank=True)
    has_lookup = models.BooleanField(default=False)
    policy_version = models.CharField(max_length=64)
    registered = models.BooleanField(
        default=True, help_text="False when the code no longer registers this tool."
    )
    # Limits across every worker (API.md "Slow tools", executor/policy/tool_limits.py): what the
    # tool declares, mirrored here, and an admin's override of each, which wins.
    max_in_flight = models.PositiveIntegerField(
        null=True, blank=True, help_text="Declared: calls of this tool in flight at once."
    )
    rate = models.CharField(
        max_length=20, blank=True, help_text="Declared: calls started per period, e.g. 20/s."
    )
    max_in_flight_override = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1)],
        help_text="Calls in flight at once across all workers; wins over the declaration.",
    )
    rate_override = models.CharField(
        max_length=20,
        blank=True,
        validators=[validate_rate],
        help_text="Calls started per period across all workers (20/s, 600/m, 1000/h); wins "
        "over the declaration.",
    )
    # The rate's token bucket (executor/policy/tool_limits.py), written by the claims that take it.
    rate_tokens = models.FloatField(null=True, blank=True, editable=False)
    rate_refilled_at = models.DateTimeField(null=True, blank=True, editable=False)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]
        permissions = [("use_tool", "Use this tool (agents)")]

    def __str__(self) -> str:
        return self.name


class HttpToolSpec(models.Model):
    """An HTTP tool defined as data (API.md "Your own tools"): `manage.py load_tools` or
    admin write these; every process registers them as tools (executor/tools/http.py).

    Header values may hold `${NAME}` placeholders, read from the environment at call time:
    the secrets themselves are never stored here, shown or copied into evidence.
    """

    class Method(models.TextChoices):
        GET = "GET"
        POST = "POST"
        PUT = "PUT"
        PATCH = "PATCH"
        DELETE = "DELETE"

    class HttpEffect(models.TextChoices):
        PURE = "pure"
        READ = "read"
        WRITE = "write"

    class HttpIdempotency(models.TextChoices):
        NONE = "none"
        HEADER = "header"

    class LookupFound(models.TextChoices):
        COUNT = "count", "a JSON list, or an object with a count, that is not empty"
        STATUS = "status", "200 found, 404 not found"

    class Approval(models.TextChoices):
        NEVER = "never"
        ALWAYS = "always"

    name = models.CharField(max_length=100, unique=True)
    description = models.TextField(blank=True)
    effect = models.CharField(max_length=10, choices=HttpEffect.choices)
    method = models.CharField(max_length=10, choices=Method.choices, default=Method.POST)
    url = models.CharField(max_length=2000)
    headers = models.JSONField(default=dict, blank=True)
    idempotency = models.CharField(
        max_length=10, choices=HttpIdempotency.choices, default=HttpIdempotency.NONE
    )
    idempotency_header = models.CharField(max_length=100, default="Idempotency-Key")
    lookup_url = models.CharField(max_length=2000, blank=True)
    lookup_found = models.CharField(
        max_length=10, choices=LookupFound.choices, default=LookupFound.COUNT
    )
    external_id = models.CharField(max_length=100, blank=True)
    approval = models.CharField(max_length=10, choices=Approval.choices, default=Approval.NEVER)
    compensation = models.CharField(max_length=100, blank=True)
    input_schema = models.JSONField(default=dict)
    retry = models.JSONField(default=dict, blank=True)
    redact = models.JSONField(default=list, blank=True)
    timeout_seconds = models.FloatField(default=10.0)
    # Limits across every worker (API.md "Slow tools"): empty for none.
    max_in_flight = models.PositiveIntegerField(null=True, blank=True)
    rate = models.CharField(max_length=20, blank=True, validators=[validate_rate])
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]
        verbose_name = "HTTP tool"

    def __str__(self) -> str:
        return self.name


class McpUpstream(models.Model):
    """An existing MCP server behind Stepward (API.md "MCP gateway"): `manage.py load_tools`
    or admin write what an operator declares; the workers, which alone hold the upstream's
    credentials, connect to it, list its tools here and call them (executor/gateway/).

    Each listed tool becomes the Stepward tool `<name>.<tool>`. What a tool declares (effect,
    idempotency, approval…) comes from its entry in `tool_settings`, else from its MCP
    annotations when `trust_annotations`, else from `defaults`. `${NAME}` in `env`,
    `headers` and `url` is read from the worker's environment when it connects.
    """

    name = models.CharField(max_length=40, unique=True)
    description = models.TextField(blank=True)
    # stdio: the argv a worker starts; streamable HTTP: the URL. Exactly one of them is set.
    command = models.JSONField(default=list, blank=True)
    cwd = models.CharField(max_length=1000, blank=True)
    env = models.JSONField(default=dict, blank=True)
    url = models.CharField(max_length=2000, blank=True)
    headers = models.JSONField(default=dict, blank=True)
    trust_annotations = models.BooleanField(default=False)
    defaults = models.JSONField(default=dict, blank=True)
    tool_settings = models.JSONField(default=dict, blank=True)
    timeout_seconds = models.FloatField(default=60.0)
    # Calls one worker process sends it at once; empty: 1 for a command, 8 for a URL.
    concurrency = models.PositiveSmallIntegerField(null=True, blank=True)
    # What a worker last listed: [{name, description, input_schema, annotations}]. Written
    # only when it changed (it is part of every listed tool's policy version).
    listed_tools = models.JSONField(default=list, blank=True)
    server_info = models.JSONField(default=dict, blank=True)
    listed_at = models.DateTimeField(null=True, blank=True)
    # The last attempt to list, successful or not (updated without touching updated_at).
    checked_at = models.DateTimeField(null=True, blank=True)
    list_error = models.TextField(blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]
        verbose_name = "MCP upstream"

    def __str__(self) -> str:
        return self.name


class ToolPolicy(models.Model):
    """Whether a person approves each call of a tool in one workspace (issue 11): set in
    admin or with `manage.py tool_policy`; without one, the tool's own declaration holds.

    Part of the policy version that every approval is bound to, so changing it makes the
    approvals given under the old one authorize nothing (DESIGN.md §9).
    """

    workspace = models.ForeignKey(Workspace, on_delete=models.CASCADE, related_name="policies")
    tool = models.ForeignKey(Tool, on_delete=models.CASCADE, related_name="policies")
    approval = models.CharField(
        max_length=20,
        choices=ApprovalRule.choices,
        default=ApprovalRule.BY_POLICY,
        help_text="always: every call waits for a person; never: none does; by_policy: "
        "the rules below decide.",
    )
    destructive = models.BooleanField(default=True, help_text="Destructive effects need a person.")
    irreversible = models.BooleanField(
        default=True, help_text="Writes nothing can undo (no compensation) need a person."
    )
    cost_above = models.DecimalField(
        max_digits=14,
        decimal_places=4,
        null=True,
        blank=True,
        help_text="Calls the tool estimates to cost more than this need a person.",
    )
    # `ApprovalPolicy.encoded()`, kept in step with the fields on save: authorization reads
    # it with the agents' grants, in the same query.
    encoded = models.CharField(max_length=100, editable=False)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["workspace", "tool"]
        verbose_name_plural = "tool policies"
        constraints = [
            models.UniqueConstraint(fields=["workspace", "tool"], name="toolpolicy_unique"),
        ]

    def __str__(self) -> str:
        # The tool by name (its key is a number), as admin's titles and messages show it.
        return f"{self.tool.name} in {self.workspace}: {self.approval}"

    def save(self, *args: Any, **kwargs: Any) -> None:
        self.encoded = self.policy().encoded()
        if "update_fields" in kwargs and kwargs["update_fields"] is not None:
            kwargs["update_fields"] = {*kwargs["update_fields"], "encoded"}
        super().save(*args, **kwargs)

    def policy(self) -> ApprovalPolicy:
        return ApprovalPolicy(
            rule=ApprovalRule(self.approval),
            destructive=self.destructive,
            irreversible=self.irreversible,
            cost_above=self.cost_above,
        )


class ToolUserObjectPermission(UserObjectPermissionBase):
    content_object = models.ForeignKey(Tool, on_delete=models.CASCADE)


class ToolGroupObjectPermission(GroupObjectPermissionBase):
    content_object = models.ForeignKey(Tool, on_delete=models.CASCADE)


def hash_token(token: str) -> str:
    # Tokens are 256 random bits, so a fast hash is enough; a slow one would only cost
    # every API request. A leaked table still yields no usable token.
    return hashlib.sha256(token.encode()).hexdigest()


class Agent(models.Model):
    """An agent program. Its permissions are held by its `user`, so guardian can check them."""

    workspace = models.ForeignKey(Workspace, on_delete=models.PROTECT, related_name="agents")
    name = models.CharField(max_length=100)
    user = models.OneToOneField(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="agent"
    )
    token_hash = models.CharField(max_length=64, unique=True, editable=False)
    token_prefix = models.CharField(max_length=12, editable=False)
    is_active = models.BooleanField(default=True)
    created_at = models.DateTimeField(auto_now_add=True)
    last_seen_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["workspace", "name"]
        constraints = [
            models.UniqueConstraint(fields=["workspace", "name"], name="agent_unique_name"),
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.workspace})"

    def set_new_token(self) -> str:
        """Sets a fresh token and returns it: the only time it is ever visible."""
        token = "sw_" + secrets.token_urlsafe(32)
        self.token_hash = hash_token(token)
        self.token_prefix = token[:10]
        return token


class StepQuerySet(models.QuerySet["Step"]):
    """The step queries that recur, named once (as procrastinate's manager fronts jobs)."""

    def due(self, now: datetime) -> StepQuerySet:
        """Pending steps whose time has come."""
        return self.filter(Q(not_before__isnull=True) | Q(not_before__lte=now), state=State.PENDING)

    def of_open_runs(self) -> StepQuerySet:
        return self.filter(run__status__in=TAKES_WORK)

    def leases_expired(self, now: datetime) -> StepQuerySet:
        """Steps a worker held whose lease ran out: recovery's work (DESIGN.md §7)."""
        return self.filter(state__in=LEASED, lease_expires_at__lte=now)

    def visible_to_agent(self, agent: Agent) -> StepQuerySet:
        return self.filter(run__workspace_id=agent.workspace_id)

    def in_workspaces(self, workspace_ids: Iterable[int]) -> StepQuerySet:
        return self.filter(run__workspace_id__in=workspace_ids)


class RunQuerySet(models.QuerySet["Run"]):
    def visible_to_agent(self, agent: Agent) -> RunQuerySet:
        return self.filter(workspace_id=agent.workspace_id)

    def in_workspaces(self, workspace_ids: Iterable[int]) -> RunQuerySet:
        return self.filter(workspace_id__in=workspace_ids)


class RunStatus(models.TextChoices):
    """What `executor/ledger/runs.py` moves a run between (its table says which action does)."""

    OPEN = "open"
    # Nothing left to do (no step unfinished); a step posted opens it again.
    CLOSED = "closed"
    PAUSED = "paused"
    CANCELLED = "cancelled"


# The runs whose steps may run: a closed run is an open one with nothing to do, and a step
# that is due in it all the same (posted as it was closed, replayed by a reviewer) runs.
TAKES_WORK: tuple[RunStatus, ...] = (RunStatus.OPEN, RunStatus.CLOSED)


class RunAction(models.TextChoices):
    """What a RunEvent records; one function each in `executor/ledger/runs.py`."""

    PAUSED = "paused"
    RESUMED = "resumed"
    CANCELLED = "cancelled"
    CLOSED = "closed"
    REOPENED = "reopened"
    BUDGET_EXTENDED = "budget_extended"


class Run(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    workspace = models.ForeignKey(Workspace, on_delete=models.PROTECT, related_name="runs")
    agent = models.ForeignKey(Agent, on_delete=models.PROTECT, related_name="runs")
    name = models.CharField(max_length=200)
    # NULL, not "", when absent: the unique (agent, key) constraint ignores NULLs.
    key = models.CharField(max_length=200, null=True, blank=True)  # noqa: DJ001
    # Hash of the creating request (name and budget): a repeat with the same key must match.
    request_hash = models.CharField(max_length=64, blank=True, editable=False)
    status = models.CharField(max_length=20, choices=RunStatus.choices, default=RunStatus.OPEN)
    pause_reason = models.CharField(max_length=500, blank=True)
    max_calls = models.PositiveIntegerField(null=True, blank=True)
    max_cost = models.DecimalField(max_digits=14, decimal_places=4, null=True, blank=True)
    deadline = models.DateTimeField(null=True, blank=True)
    used_calls = models.PositiveIntegerField(default=0)
    used_cost = models.DecimalField(max_digits=14, decimal_places=4, default=Decimal(0))
    version = models.PositiveIntegerField(default=1)
    # An HMAC over the run's budgets and the hash of its newest RunEvent (DESIGN.md §15):
    # a budget edited, or run events cut, behind the application's back shows.
    seal = models.CharField(max_length=64, blank=True, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    objects = RunQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            models.UniqueConstraint(
                fields=["agent", "key"], condition=Q(key__isnull=False), name="run_unique_key"
            ),
            models.CheckConstraint(
                condition=Q(status__in=RunStatus.values), name="run_status_valid"
            ),
            models.CheckConstraint(
                condition=Q(status=RunStatus.PAUSED) | Q(pause_reason=""),
                name="run_pause_reason_only_when_paused",
            ),
            models.CheckConstraint(condition=Q(used_cost__gte=0), name="run_used_cost_positive"),
        ]
        indexes = [
            models.Index(fields=["status", "updated_at"], name="run_status_updated"),
            # The runs list, newest first, a page at a time (keyset on (created_at, id)):
            # of every workspace a reviewer sees, and of one.
            models.Index(fields=["created_at", "id"], name="run_created"),
            models.Index(fields=["workspace", "created_at", "id"], name="run_workspace_created"),
        ]

    def __str__(self) -> str:
        return self.name


class Step(models.Model):
    id = models.UUIDField(primary_key=True, default=time_ordered_uuid, editable=False)
    # Indexed by (run, key) and (run, position), which lead with it: every index is one more
    # write for each step posted.
    run = models.ForeignKey(Run, on_delete=models.PROTECT, related_name="steps", db_index=False)
    # Posting order within the run.
    position = models.PositiveIntegerField()
    key = models.CharField(max_length=200)
    # Not indexed: no step is looked up by its tool alone, and a tool is unregistered, never
    # deleted (deleting one still checks, by a scan, that no step uses it).
    tool = models.ForeignKey(
        Tool,
        to_field="name",
        db_column="tool",
        on_delete=models.PROTECT,
        related_name="+",
        db_index=False,
    )
    input = models.JSONField()
    input_hash = DigestField()
    input_summary = models.TextField(blank=True)
    depends_on = models.JSONField(default=list, blank=True)
    operation_id = models.UUIDField(default=uuid.uuid4, editable=False)
    # Indexed where set only (`step_compensates`): most steps compensate nothing.
    compensates = models.ForeignKey(
        "self",
        null=True,
        blank=True,
        on_delete=models.PROTECT,
        related_name="compensations",
        db_index=False,
    )

    state = models.CharField(max_length=20, choices=State.choices, default=State.PLANNED)
    version = models.PositiveIntegerField(default=1)
    # Hash of the newest Event: the head of this step's chain (see Event).
    head_hash = DigestField(blank=True)

    lease_owner = models.CharField(max_length=200, blank=True)
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    fence = models.PositiveIntegerField(default=0)

    attempt_count = models.PositiveIntegerField(default=0)
    not_before = models.DateTimeField(null=True, blank=True)
    first_scheduled_at = models.DateTimeField(null=True, blank=True)

    external_id = models.CharField(max_length=200, blank=True)
    result = models.JSONField(null=True, blank=True)
    failure_class = models.CharField(max_length=40, blank=True)
    failure_message = models.TextField(blank=True)

    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    # When the step entered its present state: the inbox's "waiting since". A move that
    # keeps the state (an automatic lookup that leaves it unknown) does not change it.
    state_since = models.DateTimeField(default=timezone.now)

    objects = StepQuerySet.as_manager()

    class Meta:
        ordering = ["run", "position"]
        constraints = [
            models.UniqueConstraint(fields=["run", "key"], name="step_unique_key"),
            models.UniqueConstraint(fields=["run", "position"], name="step_unique_position"),
            models.CheckConstraint(condition=Q(state__in=State.values), name="step_state_valid"),
            models.CheckConstraint(condition=Q(version__gte=1), name="step_version_positive"),
            # A lease exists exactly while a worker holds the step.
            models.CheckConstraint(
                condition=(
                    Q(state__in=[State.RUNNING, State.VERIFYING], lease_expires_at__isnull=False)
                    & ~Q(lease_owner="")
                )
                | (
                    ~Q(state__in=[State.RUNNING, State.VERIFYING])
                    & Q(lease_expires_at__isnull=True, lease_owner="")
                ),
                name="step_lease_iff_leased_state",
            ),
            models.CheckConstraint(
                condition=~Q(state__in=[State.FAILED, State.DEAD]) | ~Q(failure_class=""),
                name="step_failure_has_class",
            ),
            models.CheckConstraint(
                condition=Q(compensates__isnull=True) | ~Q(compensates=models.F("id")),
                name="step_not_self_compensating",
            ),
            models.CheckConstraint(
                condition=~Q(state=State.RUNNING) | Q(fence__gte=1),
                name="step_running_is_fenced",
            ),
        ]
        indexes = [
            # The inbox: what waits for a person, longest waiting first.
            models.Index(fields=["state", "state_since"], name="step_state_since"),
            models.Index(
                fields=["compensates"],
                condition=Q(compensates__isnull=False),
                name="step_compensates",
            ),
            # Due work, run by run, oldest first: the fair claim's range scan of each open
            # run's first due steps (executor/engine/claiming.py); the sweeper's and the
            # metrics' looks at all due work read it whole (it holds only pending steps).
            models.Index(
                fields=["run", "not_before", "position"],
                condition=Q(state=State.PENDING),
                name="step_due_in_run",
            ),
            # A run's steps in one state, in posting order: the run page's report lists each
            # section's first steps without reading the run (a range scan bounded by LIMIT).
            # Completed steps, most of a ledger, are not in it: a run's first completed ones
            # are read in posting order from `step_unique_position`.
            models.Index(
                fields=["run", "state", "position"],
                condition=~Q(state=State.COMPLETED),
                name="step_run_incomplete",
            ),
            # Expired leases.
            models.Index(
                fields=["lease_expires_at"],
                condition=Q(state__in=[State.RUNNING, State.VERIFYING]),
                name="step_leased",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.key} ({self.tool_id}, {self.state})"

    @property
    def failure(self) -> dict[str, str] | None:
        if not self.failure_class:
            return None
        return {"class": self.failure_class, "message": self.failure_message}


class StepCounter(models.Model):
    """The last position a run handed out, so that posts number their steps with one atomic
    increment of this row: no lock on the run (which workers update for budgets) and no
    scan for the run's highest position."""

    run = models.OneToOneField(
        Run, primary_key=True, on_delete=models.CASCADE, related_name="step_counter"
    )
    last_position = models.PositiveIntegerField(default=0)

    def __str__(self) -> str:
        return f"{self.run_id}: {self.last_position}"


class Phase(models.TextChoices):
    CLAIMED = "claimed"
    SUBMITTING = "submitting"
    RESPONDED = "responded"
    # Closed without a response: the error is classified in error_class.
    ERRORED = "errored"
    # Closed by recovery or a pause; nothing more will be written by its worker.
    ABANDONED = "abandoned"


OPEN_PHASES = (Phase.CLAIMED, Phase.SUBMITTING)


class Attempt(models.Model):
    # Not indexed alone: (step, number), unique, leads with it.
    step = models.ForeignKey(
        Step, on_delete=models.PROTECT, related_name="attempts", db_index=False
    )
    number = models.PositiveIntegerField()
    fence = models.PositiveIntegerField()
    worker = models.CharField(max_length=200)
    phase = models.CharField(max_length=20, choices=Phase.choices, default=Phase.CLAIMED)
    request_evidence = models.JSONField(null=True, blank=True)
    response_evidence = models.JSONField(null=True, blank=True)
    error_class = models.CharField(max_length=40, blank=True)
    error_message = models.TextField(blank=True)
    cost = models.DecimalField(max_digits=14, decimal_places=4, default=Decimal(0))
    # A write this worker tried after its lease was taken over, refused by the fence.
    fenced_out_at = models.DateTimeField(null=True, blank=True)
    fenced_out_write = models.CharField(max_length=200, blank=True)
    # What that worker's refused write carried. A note outside the chain: a closed attempt's
    # own fields never change again, so the checkpoints can sign them (DESIGN.md §15).
    fenced_out_evidence = models.JSONField(null=True, blank=True)
    claimed_at = models.DateTimeField(auto_now_add=True)
    submitted_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["step", "number"]
        # One attempt a fence and one open attempt a step are kept by a trigger, not unique
        # indexes: no index reads `phase`, so an attempt's moves can be HOT updates, and
        # (step, fence) costs no index (executor/ledger/guards.py).
        constraints = [
            models.UniqueConstraint(fields=["step", "number"], name="attempt_unique_number"),
            models.CheckConstraint(condition=Q(phase__in=Phase.values), name="attempt_phase_valid"),
            models.CheckConstraint(
                condition=~Q(phase__in=[Phase.SUBMITTING, Phase.RESPONDED])
                | Q(submitted_at__isnull=False),
                name="attempt_submitted_has_time",
            ),
        ]

    def __str__(self) -> str:
        return f"attempt {self.number} of {self.step_id}"


# What an Event's hash covers: 1 for events written before it covered the run and the
# step_digest (DESIGN.md §15), 2 since; 3 also means that each approval of the step is named
# by the digest of its content in the data of the event that recorded it.
EVENT_FORMAT = 3


class Event(models.Model):
    """One state change, append-only, hash-chained per step.

    `seq` equals the step's version after the move, so a step's chain has no gaps and the
    (step, seq) constraint refuses a second event for one version.
    """

    # Indexed by `event_run` and the unique (step, seq), which lead with them.
    run = models.ForeignKey(Run, on_delete=models.PROTECT, related_name="events", db_index=False)
    step = models.ForeignKey(Step, on_delete=models.PROTECT, related_name="events", db_index=False)
    seq = models.PositiveIntegerField()
    from_state = models.CharField(max_length=20, blank=True)
    to_state = models.CharField(max_length=20)
    actor = models.CharField(max_length=200)
    reason = models.TextField(blank=True)
    data = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField()
    prev_hash = DigestField(blank=True)
    hash = DigestField()
    # A digest of what the step was right after this move (its run, key, tool, input hash,
    # state, external id and result): the hash covers it, so an edit of the step row shows.
    step_digest = DigestField(blank=True)
    # EVENT_FORMAT when it was written.
    format = models.PositiveSmallIntegerField(default=EVENT_FORMAT)

    class Meta:
        ordering = ["step", "seq"]
        constraints = [
            models.UniqueConstraint(fields=["step", "seq"], name="event_unique_seq"),
        ]
        indexes = [
            # A run's events (a run's deletion checks none is left; the drill reads them):
            # the run alone, so that PostgreSQL's B-tree deduplication stores each run once
            # with its rows' addresses, about 7 bytes an event where (run, created_at) took
            # 44 (132 MB at a million steps, issue 25).
            models.Index(fields=["run"], name="event_run"),
            # The decisions page: people's moves only, newest first. Partial, so the engine's
            # own moves (nearly every event) cost it nothing.
            models.Index(
                fields=["created_at", "id"],
                condition=Q(actor__startswith="user:"),
                name="event_by_person",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.from_state or '∅'} → {self.to_state} by {self.actor}"

    def content(self) -> dict[str, Any]:
        """What the event's hash covers."""
        content = {
            "step": str(self.step_id),
            "seq": self.seq,
            "from": self.from_state,
            "to": self.to_state,
            "actor": self.actor,
            "reason": self.reason,
            "data": self.data,
            "at": self.created_at.isoformat(),
            "prev": self.prev_hash,
        }
        if self.format >= 2:
            content["run"] = str(self.run_id)
            content["step_digest"] = self.step_digest
        return content


class Approval(models.Model):
    """Who approved which exact call. It authorizes one execution of that call only."""

    step = models.ForeignKey(Step, on_delete=models.PROTECT, related_name="approvals")
    input_hash = models.CharField(max_length=64)
    tool = models.CharField(max_length=100)
    policy_version = models.CharField(max_length=64)
    # Indexed where set only (`approval_by_person`): the policy approves most steps.
    approver = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.PROTECT,
        related_name="approvals",
        help_text="Empty when the tool's policy approved the step.",
        db_index=False,
    )
    reason = models.TextField(blank=True)
    approved_at = models.DateTimeField()
    expires_at = models.DateTimeField(null=True, blank=True)
    # Set when the approval is used up or replaced.
    consumed_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-approved_at"]
        constraints = [
            models.UniqueConstraint(
                fields=["step"],
                condition=Q(consumed_at__isnull=True, revoked_at__isnull=True),
                name="approval_one_live_per_step",
            ),
            models.CheckConstraint(
                condition=Q(approver__isnull=True) | Q(expires_at__isnull=False),
                name="approval_by_person_expires",
            ),
        ]
        indexes = [
            models.Index(
                fields=["approver"],
                condition=Q(approver__isnull=False),
                name="approval_by_person",
            ),
        ]

    def __str__(self) -> str:
        return f"approval of {self.step_id} by {self.approver or 'policy'}"


class DrillReport(models.Model):
    version = models.CharField(max_length=100)
    started_at = models.DateTimeField()
    finished_at = models.DateTimeField(null=True, blank=True)
    parameters = models.JSONField(default=dict)
    interruption_points = models.JSONField(default=dict)
    counts = models.JSONField(default=dict)
    duplicates = models.PositiveIntegerField(default=0)
    lost = models.PositiveIntegerField(default=0)
    left_for_review = models.PositiveIntegerField(default=0)
    elapsed_seconds = models.FloatField(default=0)
    passed = models.BooleanField(default=False)
    notes = models.TextField(blank=True)

    class Meta:
        ordering = ["-started_at"]

    def __str__(self) -> str:
        return f"drill {self.started_at:%Y-%m-%d %H:%M} {'passed' if self.passed else 'FAILED'}"


# A checkpoint's listings packed (migration 0024): fixed-size records, 62% of the bytes their
# JSON took once PostgreSQL compressed it (issue 25). A head: the step, its run, its version,
# its chain's head.
HEAD_RECORD = struct.Struct(">16s16sI32s")
# A closed attempt: its id, its step, its digest.
ATTEMPT_RECORD = struct.Struct(">Q16s32s")
RECORDS = {"heads": HEAD_RECORD, "attempts": ATTEMPT_RECORD}


def pack_listing(name: str, entries: Iterable[Sequence[Any]]) -> bytes:
    """`heads` (`[step, run, version, head]`) or `attempts` (`[attempt, step, digest]`) as
    the records `unpack_listing` reads back. Raises ValueError on a digest that is not 64
    hex characters."""
    out = bytearray()
    for entry in entries:
        if name == "heads":
            step, run, version, head = entry
            out += HEAD_RECORD.pack(
                uuid.UUID(str(step)).bytes, uuid.UUID(str(run)).bytes, version, _digest(head)
            )
        else:
            attempt, step, digest = entry
            out += ATTEMPT_RECORD.pack(int(attempt), uuid.UUID(str(step)).bytes, _digest(digest))
    return bytes(out)


def unpack_listing(name: str, data: bytes) -> list[list[Any]]:
    """The entries of whole records in `data`, as their JSON listing held them."""
    record = RECORDS[name]
    whole = memoryview(data)[: len(data) - len(data) % record.size]
    if name == "heads":
        return [
            [str(uuid.UUID(bytes=step)), str(uuid.UUID(bytes=run)), version, head.hex()]
            for step, run, version, head in HEAD_RECORD.iter_unpack(whole)
        ]
    return [
        [str(attempt), str(uuid.UUID(bytes=step)), digest.hex()]
        for attempt, step, digest in ATTEMPT_RECORD.iter_unpack(whole)
    ]


def _digest(value: str) -> bytes:
    raw = bytes.fromhex(value)
    if len(raw) != 32:
        raise ValueError(f"not a SHA-256 digest: {value!r}")
    return raw


class Checkpoint(models.Model):
    """A signed record of where steps' chains stood (DESIGN.md §15): an anchor for them.

    Each lists `[step, run, version, head_hash]` for every step that changed since the one
    before (all steps in the first), and is chained to the one before and keyed like the
    events. Deleting a listed step, cutting its chain below the listed version or moving it
    to another run then shows, however consistently the rest was rewritten.

    Since migration 0024 the listings are packed (`packed_heads`, `packed_attempts`: records
    of `HEAD_RECORD` and `ATTEMPT_RECORD`), and the hash covers their SHA-256; checkpoints
    taken before keep their JSON listings (`heads`, `attempts`) and verify as they did.
    """

    seq = models.PositiveIntegerField(unique=True)
    taken_at = models.DateTimeField()
    # Steps updated at or after this were listed (None: every step).
    since = models.DateTimeField(null=True, blank=True)
    # Before 0024 (empty since).
    heads = models.JSONField(default=list)
    # `[attempt id, step id, digest]` of every closed attempt of the listed steps: evidence
    # and errors edited, or attempts deleted, after a checkpoint show. Before 0024.
    attempts = models.JSONField(default=list, blank=True)
    packed_heads = models.BinaryField(default=b"", blank=True)
    packed_attempts = models.BinaryField(default=b"", blank=True)
    # `[run id, steps, digest, archive file]` of every run archived and deleted since the
    # checkpoint before (API.md "Retention"): a run that is gone but listed here was
    # archived, one that is gone and listed nowhere was deleted.
    archived = models.JSONField(default=list, blank=True)
    # `[seq, hash]` of the newest checkpoint deleted before this one was taken: every
    # checkpoint up to it listed only runs archived since, so the chain of those left starts
    # after it (executor/ledger/chain.py `checkpoints_prune`).
    pruned = models.JSONField(default=list, blank=True)
    prev_hash = models.CharField(max_length=64, blank=True)
    hash = models.CharField(max_length=64)

    class Meta:
        ordering = ["seq"]

    def __str__(self) -> str:
        return f"checkpoint {self.seq} at {self.taken_at:%Y-%m-%d %H:%M:%S}"

    def listed(self, name: str) -> list[list[Any]]:
        """The entries of listing `name` ("heads" or "attempts"), packed or not."""
        packed = bytes(getattr(self, f"packed_{name}"))
        return unpack_listing(name, packed) if packed else list(getattr(self, name))

    def content(
        self,
        *,
        listings: dict[str, list[Any]] | None = None,
        packed: dict[str, tuple[int, str]] | None = None,
    ) -> dict[str, Any]:
        """What its hash is over. `listings` stands in for the JSON `heads` and `attempts`,
        `packed` for the packed ones' `(bytes, SHA-256)` (for a reader that streams them
        rather than loads them)."""
        if packed is None and listings is None:
            packed = {
                name: (len(data), hashlib.sha256(data).hexdigest())
                for name in RECORDS
                if (data := bytes(getattr(self, f"packed_{name}")))
            }
        content: dict[str, Any] = {
            "seq": self.seq,
            "taken_at": self.taken_at.isoformat(),
            "since": self.since.isoformat() if self.since else None,
            "prev": self.prev_hash,
        }
        if packed:
            content["packed"] = {
                name: {"bytes": size, "sha256": digest} for name, (size, digest) in packed.items()
            }
        else:
            listings = listings or {"heads": self.heads, "attempts": self.attempts}
            content["heads"] = listings["heads"]
            if listings["attempts"]:
                content["attempts"] = listings["attempts"]
        if self.archived:
            content["archived"] = self.archived
        if self.pruned:
            content["pruned"] = self.pruned
        return content


class SweeperLease(models.Model):
    """A named lease that one sweeper at a time holds, so two sweepers never act twice.

    It expires on its own, so a stuck sweep cannot stop the next one for longer than its
    lease; `fence` grows with every take-over.
    """

    name = models.CharField(max_length=100, primary_key=True)
    owner = models.CharField(max_length=200, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    fence = models.PositiveIntegerField(default=0)
    last_finished_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"{self.name} held by {self.owner or 'nobody'}"


class RunEvent(models.Model):
    """Append-only record of what happened to a run: paused, resumed, budget extended, cancelled."""

    run = models.ForeignKey(Run, on_delete=models.PROTECT, related_name="run_events")
    action = models.CharField(max_length=40, choices=RunAction.choices)
    actor = models.CharField(max_length=200)
    reason = models.TextField(blank=True)
    data = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    # Chained per run in id order and keyed like the step Events (DESIGN.md §15).
    prev_hash = models.CharField(max_length=64, blank=True, editable=False)
    hash = models.CharField(max_length=64, blank=True, editable=False)

    class Meta:
        ordering = ["run", "created_at", "id"]
        indexes = [models.Index(fields=["run", "created_at"], name="runevent_run_time")]

    def __str__(self) -> str:
        return f"{self.action} by {self.actor}"

    def content(self) -> dict[str, Any]:
        """What the run event's hash covers."""
        return {
            "run": str(self.run_id),
            "action": self.action,
            "actor": self.actor,
            "reason": self.reason,
            "data": self.data,
            "at": self.created_at.isoformat(),
            "prev": self.prev_hash,
        }


# --- company sign-in (docs/sign-in.md) ----------------------------------------------------


class WorkspaceRole(models.TextChoices):
    """What a group of the company's identity provider may do in a workspace."""

    REVIEWER = "reviewer", "Reviewer"
    APPROVER = "approver", "Approver"
    ADMIN = "admin", "Admin"


# Each role holds the one before it. Reviewers triage (probe and resolve unknown outcomes);
# approvers also let planned steps and compensations run; admins also replay dead letters and
# extend budgets, which spend again. None of them is Django's staff: the admin site stays
# with the people given it there.
ROLE_PERMISSIONS: dict[str, tuple[str, ...]] = {
    WorkspaceRole.REVIEWER: ("review_steps", "resolve_unknown"),
    WorkspaceRole.APPROVER: (
        "review_steps",
        "resolve_unknown",
        "approve_steps",
        "approve_compensation",
    ),
    WorkspaceRole.ADMIN: REVIEWER_PERMISSIONS,
}


class SignInRole(models.Model):
    """A group the identity provider names in its group claim, mapped to a role in a workspace.

    Its members hold the role through `group`, a Django group this row owns and keeps
    (executor/services/signin.py): membership is re-synced from the claim at every sign-in,
    and the authorization recheck reads group grants like any other.
    """

    workspace = models.ForeignKey(Workspace, on_delete=models.CASCADE, related_name="sign_in_roles")
    idp_group = models.CharField(
        "identity provider group",
        max_length=255,
        help_text="The group's name (or id, for Entra ID) exactly as the group claim carries it.",
    )
    role = models.CharField(max_length=16, choices=WorkspaceRole.choices)
    group = models.OneToOneField(
        "auth.Group", on_delete=models.PROTECT, related_name="sign_in_role", editable=False
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["workspace", "idp_group"]
        verbose_name = "sign-in group role"
        constraints = [
            models.UniqueConstraint(
                fields=["workspace", "idp_group"], name="signinrole_one_role_per_group"
            ),
            models.CheckConstraint(
                condition=Q(role__in=WorkspaceRole.values), name="signinrole_role_known"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.idp_group} → {self.role} in {self.workspace}"


class SignInIdentity(models.Model):
    """Who a user is at the identity provider: its issuer and the subject it never reuses.

    A user signed in through the provider is found by this pair, never by a username or an
    email address, which a provider may let people choose or may give to someone else later.
    """

    user = models.OneToOneField(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="sign_in_identity"
    )
    issuer = models.CharField(max_length=255)
    subject = models.CharField(max_length=255)
    # What the group claim said at the last sign-in, for the admin's eyes only.
    idp_groups = models.JSONField(default=list, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    last_sign_in_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["issuer", "subject"]
        verbose_name_plural = "sign-in identities"
        constraints = [
            models.UniqueConstraint(fields=["issuer", "subject"], name="signinidentity_one_user"),
        ]

    def __str__(self) -> str:
        return f"{self.subject} at {self.issuer}"


# --- notifications (API.md "Notifications") -------------------------------------------------


class NotifyKind(models.TextChoices):
    """Why an item waits for a person: the inbox's kinds (`executor.ledger.selectors.InboxKind`) and
    paused runs. The same words are the console's inbox filter (`?state=`)."""

    APPROVAL = "approval", "Awaiting approval"
    COMPENSATION = "compensation", "Compensation request"
    UNKNOWN = "unknown", "Unknown outcome"
    DEAD = "dead", "Dead letter"
    BLOCKED = "blocked", "Blocked"
    FAILED_COMPENSATION = "failed_compensation", "Failed compensation"
    PAUSED = "paused", "Paused run"


class Notification(models.Model):
    """Something started waiting for a person.

    Written by the database itself: triggers on the step and run tables (migration
    0014_notifications) insert it in the very statement that moved the step or paused the
    run, so it commits or rolls back with that move and costs the engine no statement. The
    sweeper hands it to its subscribers' messages (`fanned_out_at`,
    executor/notifications/outbox.py).
    """

    kind = models.CharField(max_length=30, choices=NotifyKind.choices)
    # No database constraint: archiving a run (its rows deleted in batches) must not wait on
    # these, and a notification of a step gone is simply not listed.
    run = models.ForeignKey(Run, on_delete=models.DO_NOTHING, db_constraint=False, related_name="+")
    step = models.ForeignKey(
        Step, on_delete=models.DO_NOTHING, db_constraint=False, null=True, related_name="+"
    )
    created_at = models.DateTimeField()
    fanned_out_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-id"]
        indexes = [
            models.Index(
                fields=["id"], condition=Q(fanned_out_at__isnull=True), name="notification_new"
            )
        ]

    def __str__(self) -> str:
        return f"{self.kind} #{self.pk}"


def validate_kinds(value: Any) -> None:
    if not isinstance(value, list) or any(kind not in NotifyKind.values for kind in value):
        raise ValidationError(
            f"a list of kinds among {', '.join(NotifyKind.values)} (empty: every kind)"
        )


class NotifySubscription(models.Model):
    """Who is told about a workspace's waiting items: an Apprise URL (`mailto://…`,
    `slack://…`, `json://host/path` for the signed webhook). With a user, only the items that
    user may act on are sent, and only while the user holds the workspace's permission."""

    workspace = models.ForeignKey(
        Workspace, on_delete=models.CASCADE, related_name="notify_subscriptions"
    )
    name = models.CharField(max_length=200)
    # May hold credentials (a Slack token, an SMTP password): shown masked outside its form.
    url = models.TextField(help_text="An Apprise URL, e.g. json://hooks.example.com/stepward")
    kinds = models.JSONField(
        default=list,
        blank=True,
        validators=[validate_kinds],
        help_text='Which kinds of waiting items, e.g. ["approval", "unknown"]; empty: all.',
    )
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.CASCADE,
        null=True,
        blank=True,
        related_name="notify_subscriptions",
        help_text="A reviewer: only what they may decide, while they may.",
    )
    active = models.BooleanField(default=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["workspace", "name"]

    def __str__(self) -> str:
        return f"{self.workspace}: {self.name}"


class DeliveryStatus(models.TextChoices):
    PENDING = "pending"  # gathering items, waiting for its digest window or its next attempt
    SENT = "sent"
    FAILED = "failed"  # every attempt failed: given up


class NotifyDelivery(models.Model):
    """One message to one subscriber: the items gathered for it until it was sent (a digest)."""

    # `subscription:<id>`, or `setting:<hash of the URL>` for one of NOTIFY_URLS.
    subscriber = models.CharField(max_length=100)
    subscription = models.ForeignKey(
        NotifySubscription, on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    target = models.TextField(help_text="The subscriber's URL, its secrets masked.")
    status = models.CharField(
        max_length=20, choices=DeliveryStatus.choices, default=DeliveryStatus.PENDING
    )
    notifications = models.ManyToManyField(Notification, related_name="deliveries")
    # Not sent before: one message per subscriber per NOTIFY_DIGEST_SECONDS.
    send_after = models.DateTimeField()
    attempts = models.PositiveIntegerField(default=0)
    next_attempt_at = models.DateTimeField(null=True, blank=True)
    last_error = models.TextField(blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    sent_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [
            models.CheckConstraint(
                condition=Q(status__in=DeliveryStatus.values), name="notifydelivery_status_valid"
            ),
            # At most one message gathering items per subscriber.
            models.UniqueConstraint(
                fields=["subscriber"],
                condition=Q(status=DeliveryStatus.PENDING),
                name="notifydelivery_one_pending",
            ),
        ]
        indexes = [
            models.Index(
                fields=["send_after"],
                condition=Q(status=DeliveryStatus.PENDING),
                name="notifydelivery_due",
            ),
            models.Index(fields=["subscriber", "sent_at"], name="notifydelivery_last_sent"),
        ]

    def __str__(self) -> str:
        return f"{self.status} to {self.target}"


class Counter(models.Model):
    """A number the ledger keeps as it moves, for /metrics (API.md "For operators:
    metrics"): written only by the database's triggers on steps and attempts (migration
    0018), in the transaction of the write that moves it, never by this code.

    Each database session adds to rows of its own (`shard`: its server process id; 0 on
    SQLite, which has one writer at a time), so two workers never wait on one row; the
    sweeper folds the rows of sessions that have ended into shard 0 (executor/ledger/counters.py).
    A metric's value is the sum of its rows. `label_a` and `label_b` are its labels' values,
    in the order docs/metrics.md gives them ("" when it has fewer)."""

    name = models.CharField(max_length=40)
    label_a = models.CharField(max_length=200, blank=True)
    label_b = models.CharField(max_length=200, blank=True)
    shard = models.IntegerField(default=0)
    value = models.FloatField(default=0)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["name", "label_a", "label_b", "shard"], name="counter_unique"
            )
        ]

    def __str__(self) -> str:
        return f"{self.name}{{{self.label_a},{self.label_b}}}@{self.shard} = {self.value:g}"


class RunStepCount(models.Model):
    """How many of a run's steps are in each state, kept like `Counter` (same triggers,
    same shards): the runs list reads its page's counts without reading their steps."""

    # Not a foreign key: derived numbers, not part of the ledger (nothing protects them).
    run_id = models.UUIDField()
    state = models.CharField(max_length=20)
    shard = models.IntegerField(default=0)
    count = models.BigIntegerField(default=0)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["run_id", "state", "shard"], name="runstepcount_unique")
        ]

    def __str__(self) -> str:
        return f"{self.run_id} {self.state}@{self.shard} = {self.count}"


class StepClaim(models.Model):
    """A reviewer's "I am on it" for a waiting step: shown to the others, never a lock.

    Decisions stay checked by the step's version alone; a claim only tells the team who
    works the item, until it expires (CONSOLE_CLAIM_MINUTES) or is released.
    """

    step = models.OneToOneField(
        Step, on_delete=models.CASCADE, primary_key=True, related_name="claim"
    )
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")
    claimed_at = models.DateTimeField()
    expires_at = models.DateTimeField()

    def __str__(self) -> str:
        return f"{self.step_id} claimed by {self.user_id} until {self.expires_at:%H:%M}"

    def held(self, now: datetime) -> bool:
        return self.expires_at > now


class RuleAction(models.TextChoices):
    """What a matching approval rule decides (API.md "Approval rules")."""

    ALLOW = "allow", "allow: no person needed"
    REQUIRE_APPROVAL = "require_approval", "require_approval: one reviewer"
    REQUIRE_TWO = "require_two", "require_two: two different reviewers"
    REFUSE = "refuse", "refuse: fail the step as policy_denied"


class Rule(models.Model):
    """An approval rule: for calls of `tool` (or every tool, "*") in `workspace` (or every
    workspace), when the CEL condition holds, `action` decides whether a person must approve.
    The first match in `position` order decides (docs/rules.md).

    Part of the policy version every approval is bound to (through `digest`), so adding,
    changing, reordering or deleting a rule makes approvals given before authorize nothing.
    """

    position = models.IntegerField(
        default=0, help_text="Rules are tried from the lowest position up; the first match wins."
    )
    tool = models.CharField(max_length=100, help_text='A tool name, or "*" for every tool.')
    workspace = models.ForeignKey(
        Workspace,
        null=True,
        blank=True,
        on_delete=models.CASCADE,
        related_name="rules",
        help_text="Empty: every workspace.",
    )
    when = models.TextField(
        help_text="A CEL expression over input, tool, agent and run, e.g. input.amount > 100."
    )
    action = models.CharField(max_length=20, choices=RuleAction.choices)
    reason = models.CharField(max_length=500, blank=True)
    # What the policy version covers, kept in step with the fields on save: authorization
    # reads it with the agents' grants, in the same query.
    digest = models.CharField(max_length=64, editable=False)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["position", "id"]
        verbose_name = "approval rule"
        indexes = [models.Index(fields=["tool"], name="rule_tool")]

    def __str__(self) -> str:
        where = self.workspace.slug if self.workspace_id and self.workspace else "every workspace"
        return f"#{self.position} {self.tool} in {where}: {self.action} when {self.when[:60]}"

    def save(self, *args: Any, **kwargs: Any) -> None:
        self.digest = canonical_hash(self.content())
        if "update_fields" in kwargs and kwargs["update_fields"] is not None:
            kwargs["update_fields"] = {*kwargs["update_fields"], "digest"}
        super().save(*args, **kwargs)

    def clean(self) -> None:
        # The expression is checked before it is stored: its position where it is wrong.
        try:
            compile_condition(self.when)
        except ConditionError as error:
            raise ValidationError({"when": str(error)}) from None

    def content(self) -> dict[str, Any]:
        return {
            "position": self.position,
            "tool": self.tool,
            "workspace": self.workspace_id,
            "when": self.when,
            "action": self.action,
            "reason": self.reason,
        }


class Signoff(models.Model):
    """One reviewer's approval of a call that a `require_two` rule gives to two people: the
    first one waits here; the second reviewer's makes the Approval, which names both."""

    step = models.ForeignKey(Step, on_delete=models.PROTECT, related_name="signoffs")
    approver = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="signoffs"
    )
    input_hash = models.CharField(max_length=64)
    policy_version = models.CharField(max_length=64)
    reason = models.TextField(blank=True)
    signed_at = models.DateTimeField()
    # Set when the second reviewer's approval is made: the approval this signoff is part of.
    approval = models.ForeignKey(
        Approval, null=True, blank=True, on_delete=models.PROTECT, related_name="signoffs"
    )

    class Meta:
        ordering = ["signed_at", "id"]

    def __str__(self) -> str:
        return f"signoff of {self.step_id} by {self.approver}"
