"""Tools: the registry's records, HTTP tools loaded from files, approval policies."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from django.db import transaction

from executor.models import (
    HttpToolSpec,
    Tool,
    ToolPolicy,
    Workspace,
)
from executor.services.base import Invalid
from executor.tools import http as http_tools
from executor.tools.base import ApprovalRule, all_tools


def tools_sync(*, using: str = "default") -> None:
    """Mirrors the registry into the Tool table, so permissions can be granted per tool."""
    http_tools.refresh(force=True)
    registered = set()
    for tool in all_tools():
        registered.add(tool.name)
        Tool.objects.using(using).update_or_create(
            name=tool.name,
            defaults={
                "effect": tool.effect,
                "idempotency": tool.idempotency,
                "requires_approval": tool.requires_approval,
                "compensation": tool.compensation,
                "has_lookup": tool.has_lookup(),
                "policy_version": tool.policy_version(),
                "registered": True,
            },
        )
    Tool.objects.using(using).exclude(name__in=registered).update(registered=False)


@dataclass
class ToolsLoaded:
    """What `http_tools_load` did (or, checking, would do), by tool name."""

    created: list[str]
    updated: list[str]
    unchanged: list[str]
    removed: list[str]


def http_tools_load(
    *, tables: Sequence[dict[str, Any]], prune: bool = False, check: bool = False
) -> ToolsLoaded:
    """Creates or updates the HTTP tools of a TOML file's [[tool]] tables, all or nothing.

    Every table is checked first (its fields, its hosts against EXECUTOR_HTTP_ALLOWED_HOSTS,
    its schema, its compensation): any problem raises Invalid listing every one, each naming
    the tool and the field, and nothing is written. `prune` removes the HTTP tools the
    file does not name; `check` only says what loading would do. An edited tool gets a new
    policy version, so approvals of its earlier version no longer authorize anything.
    """
    existing = {spec.name: spec for spec in HttpToolSpec.objects.all()}
    in_code = http_tools.python_tool_names()
    names = [t.get("name") for t in tables]
    known = in_code | set(existing) | {n for n in names if isinstance(n, str)}
    problems: list[str] = []
    for table in tables:
        problems += http_tools.spec_errors(table, tools=known)
        name = table.get("name")
        if name in in_code:
            problems.append(f"tool {name}: field 'name': a tool of that name is defined in code")
        if isinstance(name, str) and names.count(name) > 1:
            problems.append(f"tool {name}: field 'name': the file defines it more than once")
    if problems:
        raise Invalid(
            f"{len(problems)} problem(s); nothing was loaded", {"problems": sorted(set(problems))}
        )
    report = ToolsLoaded(created=[], updated=[], unchanged=[], removed=[])
    fresh = {spec.name: spec for spec in map(http_tools.spec_from_table, tables)}
    for name, spec in fresh.items():
        old = existing.get(name)
        if old is None:
            report.created.append(name)
        elif (
            http_tools.tool_class(old).policy_version()
            != http_tools.tool_class(spec).policy_version()
            or old.description != spec.description
        ):
            report.updated.append(name)
        else:
            report.unchanged.append(name)
    if prune:
        report.removed = sorted(set(existing) - set(fresh))
    for listed in (report.created, report.updated, report.unchanged):
        listed.sort()
    if check:
        return report
    with transaction.atomic():
        for name in [*report.created, *report.updated]:
            spec = fresh[name]
            if name in existing:
                spec.pk = existing[name].pk
            spec.save()
        HttpToolSpec.objects.filter(name__in=report.removed).delete()
        tools_sync()
    return report


def tool_policy_set(
    *,
    workspace: Workspace,
    tool: str,
    approval: str,
    destructive: bool = True,
    irreversible: bool = True,
    cost_above: Decimal | None = None,
) -> ToolPolicy | None:
    """Sets whether a person approves each call of `tool` in `workspace` (issue 11);
    `approval = "default"` removes the workspace's policy, so the tool's declaration holds.

    Approvals given under the earlier policy no longer authorize anything (their policy
    version changes). Returns the policy, or None for the default.
    """
    row = Tool.objects.filter(name=tool, registered=True).first()
    if row is None:
        raise Invalid(f"no such tool: {tool}", {"tool": tool})
    if approval == "default":
        ToolPolicy.objects.filter(workspace=workspace, tool=row).delete()
        return None
    if approval not in ApprovalRule.values:
        raise Invalid(
            f"approval must be default or one of {', '.join(ApprovalRule.values)}",
            {"approval": approval},
        )
    if cost_above is not None and cost_above < 0:
        raise Invalid("cost_above must not be negative", {"cost_above": str(cost_above)})
    found, _ = ToolPolicy.objects.update_or_create(
        workspace=workspace,
        tool=row,
        defaults={
            "approval": approval,
            "destructive": destructive,
            "irreversible": irreversible,
            "cost_above": cost_above,
        },
    )
    return found
