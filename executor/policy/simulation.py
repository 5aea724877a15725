"""What approval rules would have done to recent calls (`manage.py rules_simulate`, the rule's
admin page): each call weighed as its claim would weigh it, nothing written."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from executor.contract.tool import find_tool
from executor.ledger.records import Approval, Rule, Step, Workspace, canonical_hash
from executor.ledger.states import State
from executor.policy import authorization

DEFAULT_LAST = 1000


@dataclass(frozen=True)
class SimulatedCall:
    step_id: Any
    key: str
    tool: str
    run: str
    agent: str
    posted_at: datetime
    summary: str
    # What happened under the rules in force then: allowed, approved by a person, …
    happened: str
    # What the simulated rules decide: allow, require_approval, require_two or refuse.
    would: str
    decided_by: str
    rule_id: int | None

    @property
    def to_person(self) -> bool:
        return self.would in ("require_approval", "require_two")

    @property
    def changed(self) -> bool:
        was_person = self.happened.startswith(("approved by", "waiting", "rejected"))
        was_refused = self.happened.startswith("refused")
        return (self.would == "refuse") != was_refused or (
            self.would != "refuse" and self.to_person != was_person
        )


@dataclass
class Simulation:
    calls: list[SimulatedCall] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    @property
    def counts(self) -> Counter[str]:
        return Counter(call.would for call in self.calls)

    @property
    def changed(self) -> list[SimulatedCall]:
        return [call for call in self.calls if call.changed]


def compiled(rules: Sequence[Rule]) -> list[authorization.CompiledRule]:
    """Rules not stored (a file's), compiled for a simulation, each with a stand-in id."""
    out = []
    for number, rule in enumerate(rules, start=1):
        rule.pk = rule.pk or -number
        # As saving would: the compiled rules are cached by id and digest.
        rule.digest = canonical_hash(rule.content())
        out.append(authorization.compiled_rule(rule))
    return out


def rules_simulate(
    *,
    rules: Sequence[authorization.CompiledRule] | None = None,
    workspace: Workspace | None = None,
    tool: str = "",
    last: int = DEFAULT_LAST,
) -> Simulation:
    """Weighs the `last` calls agents posted (in `workspace`, of `tool`: all when not given)
    against `rules` (None: the stored rules) and says, for each, what happened and what the
    rules would do. Compensations are left out: a person always approves those."""
    steps = Step.objects.select_related("run", "run__agent").filter(compensates__isnull=True)
    if workspace is not None:
        steps = steps.filter(run__workspace=workspace)
    if tool:
        steps = steps.filter(tool_id=tool)
    recent = list(steps.order_by("-created_at")[:last])
    by_person = {
        approval.step_id: approval
        for approval in Approval.objects.select_related("approver")
        .filter(step_id__in=[step.pk for step in recent], approver__isnull=False)
        .order_by("approved_at")
    }
    simulation = Simulation()
    facts_by_workspace: dict[int, authorization.Facts] = {}
    for step in recent:
        contract = find_tool(step.tool_id)
        if contract is None:
            simulation.skipped.append(f"{step.key}: the tool {step.tool_id} is not registered")
            continue
        workspace_id = step.run.workspace_id
        if workspace_id not in facts_by_workspace:
            tools = {s.tool_id for s in recent if s.run.workspace_id == workspace_id}
            facts = authorization.workspace_facts(workspace_id, tools)
            if rules is not None:
                facts.candidate_rules = list(rules)
            facts_by_workspace[workspace_id] = facts
        requirement = facts_by_workspace[workspace_id].requirement(
            workspace_id, contract, authorization.call_variables(step, contract)
        )
        simulation.calls.append(
            SimulatedCall(
                step_id=step.pk,
                key=step.key,
                tool=step.tool_id,
                run=step.run.name,
                agent=step.run.agent.name,
                posted_at=step.created_at,
                summary=step.input_summary[:120],
                happened=_happened(step, by_person.get(step.pk)),
                would=requirement.label,
                decided_by=requirement.describe(),
                rule_id=requirement.rule.id if requirement.rule else None,
            )
        )
    return simulation


def _happened(step: Step, approval: Approval | None) -> str:
    if step.failure_class == "policy_denied":
        return "refused by a rule"
    if approval is not None and approval.approver is not None:
        return f"approved by {approval.approver.get_username()}"
    if step.state == State.PLANNED:
        return "waiting for a person"
    if step.state == State.REJECTED:
        return "rejected by a person"
    return f"allowed ({step.state})"
