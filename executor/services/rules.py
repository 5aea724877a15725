"""Approval rules as data: `[[rule]]` tables checked and loaded (API.md "Approval rules",
docs/rules.md). Admin edits the same records."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from django.db import transaction

from executor.common.conditions import ConditionError, compile_condition
from executor.ledger.records import Rule, RuleAction, Workspace
from executor.services.base import Invalid

RULE_KEYS = frozenset({"tool", "workspace", "when", "action", "reason", "order"})


@dataclass(frozen=True)
class RuleSpec:
    """One checked `[[rule]]` table: what a Rule row holds."""

    position: int
    tool: str
    workspace: Workspace | None
    when: str
    action: RuleAction
    reason: str

    def content(self) -> dict[str, Any]:
        return {
            "position": self.position,
            "tool": self.tool,
            "workspace": self.workspace.pk if self.workspace else None,
            "when": self.when,
            "action": str(self.action),
            "reason": self.reason,
        }

    def row(self) -> Rule:
        return Rule(
            position=self.position,
            tool=self.tool,
            workspace=self.workspace,
            when=self.when,
            action=self.action,
            reason=self.reason,
        )


def rules_check(tables: Sequence[dict[str, Any]]) -> list[RuleSpec]:
    """Checks every `[[rule]]` table: Invalid listing each problem (naming the rule by its
    number in the file, the field and, for a condition, the line and column), else the rules
    in the order they will be tried. A rule's `order` is its position; without one, its
    place in the file (1, 2, …)."""
    problems: list[str] = []
    specs: list[RuleSpec] = []
    workspaces = {w.slug: w for w in Workspace.objects.all()}
    for index, table in enumerate(tables, start=1):
        where = f"[[rule]] #{index}"
        found = _rule_problems(table, workspaces)
        if found:
            problems += [f"{where}: {problem}" for problem in found]
            continue
        slug = table.get("workspace")
        specs.append(
            RuleSpec(
                position=int(table.get("order", index)),
                tool=table["tool"],
                workspace=workspaces[slug] if slug else None,
                when=table["when"],
                action=RuleAction(table["action"]),
                reason=table.get("reason", ""),
            )
        )
    if problems:
        raise Invalid(
            f"{len(problems)} problem(s) in the rules: {problems[0]}", {"problems": problems}
        )
    return sorted(specs, key=lambda spec: spec.position)


def _rule_problems(table: dict[str, Any], workspaces: dict[str, Workspace]) -> list[str]:
    problems = [f"unknown key {key!r}" for key in sorted(set(table) - RULE_KEYS)]
    tool = table.get("tool")
    if not isinstance(tool, str) or not tool:
        problems.append('tool: a tool name, or "*" for every tool')
    slug = table.get("workspace")
    if slug is not None and (not isinstance(slug, str) or slug not in workspaces):
        problems.append(f"workspace: no workspace {slug!r}")
    action = table.get("action")
    if action not in RuleAction.values:
        problems.append(f"action: one of {', '.join(RuleAction.values)}, not {action!r}")
    reason = table.get("reason", "")
    if not isinstance(reason, str) or len(reason) > 500:
        problems.append("reason: a text of at most 500 characters")
    order = table.get("order")
    if order is not None and (isinstance(order, bool) or not isinstance(order, int)):
        problems.append("order: an integer")
    when = table.get("when")
    if not isinstance(when, str):
        problems.append("when: a CEL expression, as a string")
    else:
        try:
            compile_condition(when)
        except ConditionError as error:
            problems.append(f"when: {error}")
    return problems


@dataclass
class RulesLoaded:
    changed: bool = False
    rules: list[RuleSpec] = field(default_factory=list)
    removed: int = 0


def rules_load(*, tables: Sequence[dict[str, Any]], check: bool = False) -> RulesLoaded:
    """Makes the file's rules the rule list, all or nothing. Loading the same rules again
    changes nothing (and so no approval); any difference replaces the list, which is a new
    policy version for every tool the old or new rules name. `check` writes nothing."""
    specs = rules_check(tables)
    current = list(Rule.objects.order_by("position", "id"))
    same = [r.content() for r in current] == [s.content() for s in specs]
    report = RulesLoaded(changed=not same, rules=specs, removed=0 if same else len(current))
    if same or check:
        return report
    with transaction.atomic():
        Rule.objects.all().delete()
        for spec in specs:
            spec.row().save(force_insert=True)
    return report
