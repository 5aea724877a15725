"""Authorization rechecked at every claim (DESIGN.md §9), approvals and budgets (§10)."""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.db import connection
from django.db.models import F, Q
from django.utils import timezone

from executor import runs
from executor.models import (
    Approval,
    Run,
    RunStatus,
    Step,
    Tool,
    ToolGroupObjectPermission,
    ToolPolicy,
    ToolUserObjectPermission,
    WorkspaceGroupObjectPermission,
    WorkspaceUserObjectPermission,
)
from executor.tools.base import ApprovalPolicy
from executor.tools.base import Tool as ToolContract


class Verdict(enum.StrEnum):
    GO = "go"
    BLOCK = "block"  # authorization or a precondition failed: a person must look
    CANCEL = "cancel"  # the run was cancelled
    PAUSE = "pause"  # the run is paused or out of budget: the step waits


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.verdict == Verdict.GO


GO = Decision(Verdict.GO)


def approval_permission(step: Step) -> str:
    """The permission that approves this step: compensations have their own."""
    return "approve_compensation" if step.compensates_id else "approve_steps"


# --- the facts authorization reads, once per batch (DESIGN.md §9, §14) --------------------

WORKSPACE_CODENAMES = ("submit_steps", "approve_steps", "approve_compensation")
# Rows of `grants` that are not permissions: the tool is registered; the user is a superuser.
REGISTERED = "registered"
SUPERUSER = "superuser"
# A workspace's approval policy for a tool: this prefix, then ApprovalPolicy.encoded().
POLICY = "policy:"


@dataclass
class Facts:
    """What the authorization of a batch of steps needs, read in two queries.

    `grants` holds (user id, codename, workspace id, tool name) for the object permissions
    that matter (as guardian grants them: to the user or through a group), plus a row per
    registered tool and per active superuser.
    """

    grants: set[tuple[int, str, int | None, str]] = field(default_factory=set)
    approvals: dict[Any, Approval] = field(default_factory=dict)
    # approval_version by (workspace, tool): the same for every step of a batch.
    _versions: dict[tuple[int, str], str] = field(default_factory=dict, repr=False)

    def holds(
        self, user_id: int, codename: str, *, workspace_id: int | None = None, tool: str = ""
    ) -> bool:
        if (user_id, SUPERUSER, None, "") in self.grants:
            return True
        return (user_id, codename, workspace_id, tool) in self.grants

    def registered(self, tool: str) -> bool:
        return (0, REGISTERED, None, tool) in self.grants

    def approval_policy(self, workspace_id: int, tool: ToolContract) -> ApprovalPolicy | None:
        """The workspace's own approval policy for the tool, None where it has none."""
        for _, codename, workspace, name in self.grants:
            if codename.startswith(POLICY) and workspace == workspace_id and name == tool.name:
                return ApprovalPolicy.decoded(codename.removeprefix(POLICY))
        return None

    def needs_person(self, workspace_id: int, tool: ToolContract, input: Any) -> bool:
        """Whether a person must approve this call of `tool` in the workspace."""
        policy = self.approval_policy(workspace_id, tool)
        if policy is None:
            return tool.needs_approval(input)
        return policy.needs_person(tool, input)

    def approval_version(self, workspace_id: int, tool: ToolContract) -> str:
        key = (workspace_id, tool.name)
        if key not in self._versions:
            self._versions[key] = approval_version(tool, self.approval_policy(workspace_id, tool))
        return self._versions[key]


def read_facts(steps: Sequence[Step]) -> Facts:
    """The permissions, tool registrations and live approvals behind `steps`' authorization.

    `step.run.agent.user` is expected to be loaded. Two queries, whatever the batch size.
    """
    if not steps:
        return Facts()
    approvals = {
        approval.step_id: approval
        for approval in Approval.objects.select_related("approver").filter(
            step_id__in=[step.pk for step in steps],
            consumed_at__isnull=True,
            revoked_at__isnull=True,
        )
    }
    users = {step.run.agent.user_id for step in steps}
    users |= {a.approver_id for a in approvals.values() if a.approver_id is not None}
    return Facts(
        grants=grants(
            users=users,
            workspaces={step.run.workspace_id for step in steps},
            tools={step.tool_id for step in steps},
        ),
        approvals=approvals,
    )


def grants(
    *, users: Iterable[int], workspaces: Iterable[int], tools: Iterable[str]
) -> set[tuple[int, str, int | None, str]]:
    """Every grant of `users` on `workspaces` and `tools` that authorization asks about, in
    one query (guardian would ask four per check: user and group, workspace and tool).

    Written as SQL: it runs on every post and every claim, and the ORM took several times
    longer to build this union than the database took to answer it.
    """
    users, workspaces, tools = list(users), list(workspaces), list(tools)
    user_model = get_user_model()
    tables = {
        "wu": WorkspaceUserObjectPermission._meta.db_table,
        "wg": WorkspaceGroupObjectPermission._meta.db_table,
        "tu": ToolUserObjectPermission._meta.db_table,
        "tg": ToolGroupObjectPermission._meta.db_table,
        "tool": Tool._meta.db_table,
        "user": user_model._meta.db_table,
        "member": user_model.groups.through._meta.db_table,
        "perm": Permission._meta.db_table,
        "policy": ToolPolicy._meta.db_table,
    }

    def marks(values: list[Any]) -> str:
        return ", ".join(["%s"] * len(values)) or "NULL"

    u, w, t, c = marks(users), marks(workspaces), marks(tools), marks(list(WORKSPACE_CODENAMES))
    # Table names come from the models, values are parameters: nothing from a request.
    sql = (
        "SELECT g.user_id, p.codename, g.content_object_id, '' "  # noqa: S608
        "FROM {wu} g JOIN {perm} p ON p.id = g.permission_id "
        f"WHERE g.user_id IN ({u}) AND g.content_object_id IN ({w}) AND p.codename IN ({c}) "
        "UNION ALL "
        "SELECT m.user_id, p.codename, g.content_object_id, '' "
        "FROM {wg} g JOIN {perm} p ON p.id = g.permission_id "
        "JOIN {member} m ON m.group_id = g.group_id "
        f"WHERE m.user_id IN ({u}) AND g.content_object_id IN ({w}) AND p.codename IN ({c}) "
        "UNION ALL "
        "SELECT g.user_id, p.codename, NULL, t.name "
        "FROM {tu} g JOIN {perm} p ON p.id = g.permission_id "
        "JOIN {tool} t ON t.id = g.content_object_id "
        f"WHERE g.user_id IN ({u}) AND t.name IN ({t}) AND p.codename = 'use_tool' "
        "UNION ALL "
        "SELECT m.user_id, p.codename, NULL, t.name "
        "FROM {tg} g JOIN {perm} p ON p.id = g.permission_id "
        "JOIN {member} m ON m.group_id = g.group_id JOIN {tool} t ON t.id = g.content_object_id "
        f"WHERE m.user_id IN ({u}) AND t.name IN ({t}) AND p.codename = 'use_tool' "
        "UNION ALL "
        f"SELECT 0, '{REGISTERED}', NULL, t.name FROM {{tool}} t "
        f"WHERE t.name IN ({t}) AND t.registered = %s "
        "UNION ALL "
        f"SELECT x.id, '{SUPERUSER}', NULL, '' FROM {{user}} x "
        f"WHERE x.id IN ({u}) AND x.is_superuser = %s AND x.is_active = %s "
        "UNION ALL "
        f"SELECT 0, '{POLICY}' || p.encoded, p.workspace_id, t.name "
        "FROM {policy} p JOIN {tool} t ON t.id = p.tool_id "
        f"WHERE p.workspace_id IN ({w}) AND t.name IN ({t})"
    ).format(**{name: connection.ops.quote_name(table) for name, table in tables.items()})
    codenames = list(WORKSPACE_CODENAMES)
    params: list[Any] = [
        *users, *workspaces, *codenames,
        *users, *workspaces, *codenames,
        *users, *tools,
        *users, *tools,
        *tools, True,
        *users, True, True,
        *workspaces, *tools,
    ]  # fmt: skip
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return {(row[0], row[1], row[2], row[3]) for row in cursor.fetchall()}


def approval_version(tool: ToolContract, policy: ApprovalPolicy | None) -> str:
    """What an approval is bound to: the tool's declarations and the workspace's approval
    policy for it, if any. A change to either makes earlier approvals authorize nothing."""
    if policy is None:
        return tool.policy_version()
    text = f"{tool.policy_version()}|{policy.encoded()}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def workspace_facts(workspace_id: int, tools: Iterable[str]) -> Facts:
    """The workspace's approval policies for `tools` (one query), for reviewers' services."""
    return Facts(grants=grants(users=[], workspaces=[workspace_id], tools=tools))


def approval_problem(
    step: Step, tool: ToolContract, approval: Approval | None, now: datetime, facts: Facts
) -> str:
    """Why the live approval does not authorize this exact call, or "" when it does.

    A step the policy approved has no approval row (its Event records the policy version):
    without a live approval, the call goes only if the policy, asked again now, needs no
    person for it, so a policy made stricter since still stops it.
    """
    if approval is None:
        if needs_person(step, tool, facts):
            return "no valid approval"
        return ""
    if approval.input_hash != step.input_hash or approval.tool != step.tool_id:
        return "the approval does not match this call"
    if approval.policy_version != facts.approval_version(step.run.workspace_id, tool):
        return "the tool's policy changed since the approval"
    if approval.approver_id is not None:
        approver = approval.approver
        assert approver is not None
        max_age = timedelta(seconds=settings.EXECUTOR_APPROVAL_MAX_AGE)
        if approval.approved_at < now - max_age:
            return "the approval is older than EXECUTOR_APPROVAL_MAX_AGE"
        if approval.expires_at is not None and approval.expires_at <= now:
            return "the approval expired"
        permission = approval_permission(step)
        if not approver.is_active or not facts.holds(
            approver.pk, permission, workspace_id=step.run.workspace_id
        ):
            return f"the approver {approver.get_username()} no longer holds {permission}"
    return ""


def needs_person(step: Step, tool: ToolContract, facts: Facts) -> bool:
    """Whether a person must approve this step's call: every compensation, and what the
    workspace's policy (or else the tool's declaration) says of the call."""
    return bool(step.compensates_id) or facts.needs_person(step.run.workspace_id, tool, step.input)


def decide(step: Step, tool: ToolContract, facts: Facts, *, now: datetime) -> Decision:
    """Everything that must hold before a call: the run, the agent, the tool, the approval.

    `step.run`, `step.run.agent` and its user are expected to be loaded.
    """
    run = step.run
    if run.status == RunStatus.CANCELLED:
        return Decision(Verdict.CANCEL, "the run was cancelled")
    if run.status != RunStatus.OPEN:
        return Decision(Verdict.PAUSE, run.pause_reason or f"the run is {run.status}")
    agent = run.agent
    user = agent.user
    if not agent.is_active or not user.is_active:
        return Decision(Verdict.BLOCK, f"the agent {agent.name} is deactivated")
    if not facts.holds(user.pk, "submit_steps", workspace_id=run.workspace_id):
        return Decision(Verdict.BLOCK, f"the agent {agent.name} no longer holds submit_steps")
    if not facts.registered(step.tool_id):
        return Decision(Verdict.BLOCK, f"the tool {step.tool_id} is no longer registered")
    if not facts.holds(user.pk, "use_tool", tool=step.tool_id):
        return Decision(Verdict.BLOCK, f"the agent {agent.name} may no longer use {step.tool_id}")
    problem = approval_problem(step, tool, facts.approvals.get(step.pk), now, facts)
    if problem:
        return Decision(Verdict.BLOCK, problem)
    if run.deadline is not None and run.deadline <= now:
        return Decision(Verdict.PAUSE, "the run's deadline passed")
    return GO


def authorize(step: Step, tool: ToolContract, *, now: datetime | None = None) -> Decision:
    """`decide` for one step, with its facts read for it alone."""
    return decide(step, tool, read_facts([step]), now=now or timezone.now())


def budget_take_calls(run: Run, count: int, *, now: datetime) -> int:
    """Counts up to `count` calls against the run's budget; returns how many it may make.

    One conditional UPDATE when the budget has room for all of them, so concurrent workers
    can never overspend max_calls; where it has room for fewer, the room is read and taken
    (again conditionally). Cost is known only after a call: a call may start while cost
    remains, and the one that crosses max_cost pauses the run after it (nothing is cut off
    mid-call).
    """
    for _ in range(5):
        if count <= 0:
            return 0
        taken = Run.objects.filter(call_room(count, now=now), pk=run.pk).update(
            used_calls=F("used_calls") + count, updated_at=now
        )
        if taken == 1:
            return count
        fresh = Run.objects.get(pk=run.pk)
        if _exhaustion(fresh, now=now):
            return 0
        assert fresh.max_calls is not None  # the only limit that can leave partial room
        count = min(count, fresh.max_calls - fresh.used_calls)
    return 0


def call_room(count: int, *, now: datetime) -> Q:
    """The runs whose budget has room for `count` more calls at `now`."""
    room = Q(status=RunStatus.OPEN)
    room &= Q(max_calls__isnull=True) | Q(used_calls__lte=F("max_calls") - count)
    room &= Q(max_cost__isnull=True) | Q(used_cost__lt=F("max_cost"))
    room &= Q(deadline__isnull=True) | Q(deadline__gt=now)
    return room


# `call_room(1, now=…)` as SQL over a run's columns, for a statement that takes one call
# together with other writes (the engine's `submitting` commit on PostgreSQL). Parameters:
# %(open)s, the open status; %(now)s, the time. A test holds the two to the same answers.
ONE_CALL_ROOM_SQL = (
    "status = %(open)s"
    " AND (max_calls IS NULL OR used_calls <= max_calls - 1)"
    " AND (max_cost IS NULL OR used_cost < max_cost)"
    " AND (deadline IS NULL OR deadline > %(now)s)"
)


def budget_take_call(run: Run, *, now: datetime) -> bool:
    """Counts one call against the run's budget, atomically; False when none is left."""
    return budget_take_calls(run, 1, now=now) == 1


def budget_exhaustion(run: Run, *, now: datetime) -> str:
    """Why the run has no budget left ("" if it has), read anew from the ledger."""
    return _exhaustion(Run.objects.get(pk=run.pk), now=now)


def _exhaustion(fresh: Run, *, now: datetime) -> str:
    if fresh.status != RunStatus.OPEN:
        return fresh.pause_reason or f"the run is {fresh.status}"
    return budget_shortfall(fresh, now=now)


def budget_shortfall(fresh: Run, *, now: datetime) -> str:
    """Which of the run's budgets (deadline, calls, cost) leaves no room ("" if none),
    whatever its status: whether a paused run could resume."""
    if fresh.deadline is not None and fresh.deadline <= now:
        return "the run's deadline passed"
    if fresh.max_calls is not None and fresh.used_calls >= fresh.max_calls:
        return f"max_calls reached ({fresh.used_calls} of {fresh.max_calls})"
    if fresh.max_cost is not None and fresh.used_cost >= fresh.max_cost:
        return f"max_cost reached ({fresh.used_cost} of {fresh.max_cost})"
    return ""


def run_pause(run: Run, *, reason: str, now: datetime, actor: str = "policy") -> bool:
    """Pauses an open run with its reason; False if it was not open."""
    return runs.pause(run, reason=reason, actor=actor, now=now)
