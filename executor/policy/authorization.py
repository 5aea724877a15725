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

from executor.common.conditions import Condition as RuleCondition
from executor.common.conditions import ConditionError, EvaluationError, compile_condition
from executor.contract.tool import ApprovalPolicy
from executor.contract.tool import Tool as ToolContract
from executor.ledger import runs
from executor.ledger.records import (
    TAKES_WORK,
    Approval,
    Rule,
    RuleAction,
    Run,
    RunStatus,
    Signoff,
    Step,
    Tool,
    ToolGroupObjectPermission,
    ToolPolicy,
    ToolUserObjectPermission,
    WorkspaceGroupObjectPermission,
    WorkspaceUserObjectPermission,
)


class Verdict(enum.StrEnum):
    GO = "go"
    BLOCK = "block"  # authorization or a precondition failed: a person must look
    CANCEL = "cancel"  # the run was cancelled
    REFUSE = "refuse"  # an approval rule refuses the call: it fails as policy_denied
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
# An approval rule that applies: this prefix, then "<id>:<digest>"; its position is the
# row's first column, its workspace (None: every one) and tool ("*": every one) the others.
RULE = "rule:"


@dataclass(frozen=True)
class CompiledRule:
    """An approval rule as authorization uses it: its condition checked and ready."""

    id: int
    position: int
    tool: str
    workspace_id: int | None
    action: RuleAction
    reason: str
    when: str
    condition: RuleCondition | None  # None: stored but no longer valid (fails safe)
    problem: str = ""


# Compiled rules by digest: a rule is compiled once per process, whatever the batches.
_COMPILED: dict[str, CompiledRule] = {}


def compiled_rule(rule: Rule) -> CompiledRule:
    known = _COMPILED.get(f"{rule.pk}:{rule.digest}")
    if known is not None:
        return known
    condition, problem = None, ""
    try:
        condition = compile_condition(rule.when)
    except ConditionError as error:
        problem = str(error)
    compiled = CompiledRule(
        id=rule.pk,
        position=rule.position,
        tool=rule.tool,
        workspace_id=rule.workspace_id,
        action=RuleAction(rule.action),
        reason=rule.reason,
        when=rule.when,
        condition=condition,
        problem=problem,
    )
    if len(_COMPILED) > 5000:
        _COMPILED.clear()
    _COMPILED[f"{rule.pk}:{rule.digest}"] = compiled
    return compiled


def _compiled_rules(keys: Iterable[str]) -> dict[str, CompiledRule]:
    """The rules named by "<id>:<digest>", compiled; one query for those not yet seen."""
    keys = list(keys)
    missing = [int(key.split(":", 1)[0]) for key in keys if key not in _COMPILED]
    if missing:
        for rule in Rule.objects.filter(pk__in=missing):
            compiled_rule(rule)
    return {key: _COMPILED[key] for key in keys if key in _COMPILED}


class Need(enum.IntEnum):
    """How many people must approve a call."""

    NONE = 0
    ONE = 1
    TWO = 2


@dataclass(frozen=True)
class Requirement:
    """What the rules (or, where none matches, the tool's policy) ask of one call."""

    need: Need
    refused: bool = False
    reason: str = ""
    rule: CompiledRule | None = None
    # An evaluation error of the rule that decided (it failed safe: counted as matching).
    error: str = ""

    @property
    def label(self) -> str:
        if self.refused:
            return "refuse"
        return {Need.NONE: "allow", Need.ONE: "require_approval", Need.TWO: "require_two"}[
            self.need
        ]

    def describe(self) -> str:
        """Which rule decided and why, as a person reads it."""
        if self.rule is None:
            return "no rule matches: the tool's approval policy decides"
        text = f"rule #{self.rule.position} ({self.rule.tool}): {self.label}"
        if self.reason:
            text += f": {self.reason}"
        if self.error:
            text += f" (its condition could not be evaluated: {self.error})"
        return text


@dataclass
class Facts:
    """What the authorization of a batch of steps needs, read in two queries.

    `grants` holds (user id, codename, workspace id, tool name) for the object permissions
    that matter (as guardian grants them: to the user or through a group), plus a row per
    registered tool and per active superuser.
    """

    grants: set[tuple[int, str, int | None, str]] = field(default_factory=set)
    approvals: dict[Any, Approval] = field(default_factory=dict)
    # The reviewers' signoffs behind person approvals, by approval id (require_two).
    signoffs: dict[Any, list[Signoff]] = field(default_factory=dict)
    # approval_version by (workspace, tool): the same for every step of a batch.
    _versions: dict[tuple[int, str], str] = field(default_factory=dict, repr=False)
    _rules: dict[tuple[int, str], list[CompiledRule]] = field(default_factory=dict, repr=False)
    # Rules to weigh instead of the stored ones (a simulation of a rules file), in order.
    candidate_rules: list[CompiledRule] | None = None

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
        """Whether the tool's approval policy in the workspace asks a person to approve this
        call (approval rules aside: `requirement` weighs them first)."""
        policy = self.approval_policy(workspace_id, tool)
        if policy is None:
            return tool.needs_approval(input)
        return policy.needs_person(tool, input)

    def rules(self, workspace_id: int, tool: str) -> list[CompiledRule]:
        """The approval rules for calls of `tool` in the workspace, in the order they are
        tried (position, then id)."""
        key = (workspace_id, tool)
        if key not in self._rules and self.candidate_rules is not None:
            self._rules[key] = [
                rule
                for rule in self.candidate_rules
                if rule.workspace_id in (None, workspace_id) and rule.tool in ("*", tool)
            ]
        if key not in self._rules:
            found = [
                (position, codename.removeprefix(RULE))
                for position, codename, workspace, name in self.grants
                if codename.startswith(RULE)
                and workspace in (None, workspace_id)
                and name in ("*", tool)
            ]
            ordered = sorted(
                (position, int(text.split(":", 1)[0]), text) for position, text in found
            )
            compiled = _compiled_rules(text for _, _, text in ordered)
            self._rules[key] = [compiled[text] for _, _, text in ordered if text in compiled]
        return self._rules[key]

    def requirement(
        self, workspace_id: int, tool: ToolContract, variables: dict[str, Any]
    ) -> Requirement:
        """What the call needs: the first rule that matches decides; without one, the
        tool's approval policy. A condition that cannot be evaluated fails safe: it counts as
        matching for a rule that asks for people or refuses, and not for one that allows."""
        for rule in self.rules(workspace_id, tool.name):
            error = ""
            if rule.condition is None:
                error, matched = rule.problem, False
            else:
                try:
                    matched = rule.condition.evaluate(variables)
                except EvaluationError as failure:
                    error, matched = str(failure), False
            if error:
                matched = rule.action != RuleAction.ALLOW
            if not matched:
                continue
            if rule.action == RuleAction.REFUSE:
                return Requirement(
                    Need.NONE, refused=True, reason=rule.reason, rule=rule, error=error
                )
            need = {
                RuleAction.ALLOW: Need.NONE,
                RuleAction.REQUIRE_APPROVAL: Need.ONE,
                RuleAction.REQUIRE_TWO: Need.TWO,
            }[rule.action]
            return Requirement(need, reason=rule.reason, rule=rule, error=error)
        person = self.needs_person(workspace_id, tool, variables.get("input"))
        return Requirement(Need.ONE if person else Need.NONE)

    def approval_version(self, workspace_id: int, tool: ToolContract) -> str:
        key = (workspace_id, tool.name)
        if key not in self._versions:
            self._versions[key] = approval_version(
                tool,
                self.approval_policy(workspace_id, tool),
                self.rules(workspace_id, tool.name),
            )
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
    # Only a person's approval can rest on two signoffs: policy approvals (most) cost nothing.
    by_person = [a.pk for a in approvals.values() if a.approver_id is not None]
    signoffs: dict[Any, list[Signoff]] = {}
    if by_person:
        for signoff in Signoff.objects.select_related("approver").filter(approval_id__in=by_person):
            signoffs.setdefault(signoff.approval_id, []).append(signoff)
            users.add(signoff.approver_id)
    return Facts(
        grants=grants(
            users=users,
            workspaces={step.run.workspace_id for step in steps},
            tools={step.tool_id for step in steps},
        ),
        approvals=approvals,
        signoffs=signoffs,
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
        "rule": Rule._meta.db_table,
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
        f"WHERE p.workspace_id IN ({w}) AND t.name IN ({t}) "
        "UNION ALL "
        f"SELECT r.position, '{RULE}' || r.id || ':' || r.digest, r.workspace_id, r.tool "
        "FROM {rule} r "
        f"WHERE (r.workspace_id IN ({w}) OR r.workspace_id IS NULL) "
        f"AND (r.tool IN ({t}) OR r.tool = '*')"
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
        *workspaces, *tools,
    ]  # fmt: skip
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return {(row[0], row[1], row[2], row[3]) for row in cursor.fetchall()}


def approval_version(
    tool: ToolContract, policy: ApprovalPolicy | None, rules: Sequence[CompiledRule] = ()
) -> str:
    """What an approval is bound to: the tool's declarations, the workspace's approval
    policy for it, if any, and the approval rules that apply to it, in their order. A change
    to any makes earlier approvals authorize nothing."""
    if policy is None and not rules:
        return tool.policy_version()
    text = f"{tool.policy_version()}|{policy.encoded() if policy is not None else ''}"
    if rules:
        # Rules were added after the first two parts: a version without them is unchanged.
        content = [
            (r.id, r.position, r.tool, r.workspace_id, r.action, r.reason, r.when) for r in rules
        ]
        text += "|" + hashlib.sha256(repr(content).encode()).hexdigest()
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
        return (
            "the tool's policy changed since the approval (its declarations, the "
            "workspace's policy or the approval rules)"
        )
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
    approval rules (the first that matches), or else the workspace's policy or the tool's
    declaration, say of the call. A refusing rule counts as needing one: nobody's policy
    approval lets a refused call go. `step.run` and `step.run.agent` are expected loaded."""
    if step.compensates_id:
        return True
    requirement = facts.requirement(step.run.workspace_id, tool, call_variables(step, tool))
    return requirement.refused or requirement.need > Need.NONE


def call_variables(step: Step, tool: ToolContract) -> dict[str, Any]:
    """What a rule's condition reads of a step's call (docs/rules.md): the same at posting,
    at every claim and in a simulation, so a rule decides a call the same way each time.
    `step.run` and `step.run.agent` are expected to be loaded."""
    return rule_variables(input=step.input, tool=tool, agent_name=step.run.agent.name, run=step.run)


def rule_variables(*, input: Any, tool: ToolContract, agent_name: str, run: Run) -> dict[str, Any]:
    return {
        "input": input,
        "tool": {
            "name": tool.name,
            "effect": str(tool.effect),
            "idempotency": str(tool.idempotency),
            "irreversible": tool.is_irreversible(),
            "compensation": tool.compensation or "",
        },
        "agent": {"name": agent_name},
        "run": {"id": str(run.pk), "name": run.name, "key": run.key or ""},
    }


def signoff_problem(
    step: Step, approval: Approval, now: datetime, facts: Facts, *, need: int
) -> str:
    """Why a person's approval does not carry the `need` different reviewers a rule asks
    for ("" when it does): each still valid, for this exact call, under this version."""
    max_age = timedelta(seconds=settings.EXECUTOR_APPROVAL_MAX_AGE)
    permission = approval_permission(step)
    valid = set()
    for signoff in facts.signoffs.get(approval.pk, []):
        approver = signoff.approver
        if (
            signoff.input_hash == step.input_hash
            and signoff.policy_version == approval.policy_version
            and signoff.signed_at >= now - max_age
            and approver.is_active
            and facts.holds(approver.pk, permission, workspace_id=step.run.workspace_id)
        ):
            valid.add(approver.pk)
    if len(valid) >= need:
        return ""
    return f"a rule asks for {need} different reviewers; {len(valid)} valid approval(s)"


def decide(step: Step, tool: ToolContract, facts: Facts, *, now: datetime) -> Decision:
    """Everything that must hold before a call: the run, the agent, the tool, the approval.

    `step.run`, `step.run.agent` and its user are expected to be loaded.
    """
    run = step.run
    if run.status == RunStatus.CANCELLED:
        return Decision(Verdict.CANCEL, "the run was cancelled")
    if run.status not in TAKES_WORK:
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
    approval = facts.approvals.get(step.pk)
    need = Need.NONE
    if facts.rules(run.workspace_id, step.tool_id):
        requirement = facts.requirement(run.workspace_id, tool, call_variables(step, tool))
        if requirement.refused:
            return Decision(Verdict.REFUSE, requirement.reason or requirement.describe())
        need = requirement.need
    problem = approval_problem(step, tool, approval, now, facts)
    if not problem and need > Need.NONE and approval is not None and approval.approver_id is None:
        problem = "a rule asks for a person's approval"
    if not problem and need == Need.TWO and approval is not None:
        problem = signoff_problem(step, approval, now, facts, need=2)
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
    room = Q(status__in=TAKES_WORK)
    room &= Q(max_calls__isnull=True) | Q(used_calls__lte=F("max_calls") - count)
    room &= Q(max_cost__isnull=True) | Q(used_cost__lt=F("max_cost"))
    room &= Q(deadline__isnull=True) | Q(deadline__gt=now)
    return room


# `call_room(1, now=…)` as SQL over a run's columns, for a statement that takes one call
# together with other writes (the engine's `submitting` commit on PostgreSQL). Parameters:
# %(open)s and %(closed)s, the statuses that take work; %(now)s, the time. A test holds the
# two to the same answers.
ONE_CALL_ROOM_SQL = (
    "status IN (%(open)s, %(closed)s)"
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
    if fresh.status not in TAKES_WORK:
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
