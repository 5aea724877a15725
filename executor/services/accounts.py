"""Workspaces, agents and reviewers."""

from __future__ import annotations

import secrets
from collections.abc import Iterable

from django.contrib.auth import get_user_model
from django.contrib.auth.models import User
from django.db import transaction
from guardian.shortcuts import assign_perm, remove_perm

from executor.ledger.records import (
    AGENT_WORKSPACE_PERMISSIONS,
    REVIEWER_PERMISSIONS,
    Agent,
    Tool,
    Workspace,
)
from executor.services.base import AGENT_NAME, Conflict, Invalid
from executor.services.tools import tools_sync


def workspace_get_or_create(*, slug: str, name: str = "") -> Workspace:
    workspace, _ = Workspace.objects.get_or_create(slug=slug, defaults={"name": name or slug})
    return workspace


def agent_create(
    *, workspace: Workspace, name: str, tools: Iterable[str] | None = None
) -> tuple[Agent, str]:
    """Creates an agent with `submit_steps` on its workspace and `use_tool` on `tools`
    (every registered tool when None).

    Returns the agent and its token, which is never stored and never shown again.
    """
    if not AGENT_NAME.fullmatch(name):
        raise Invalid("an agent's name is 1 to 60 letters, digits, '.', '_' or '-'", {"name": name})
    user_model = get_user_model()
    with transaction.atomic():
        tools_sync()
        username = f"agent.{workspace.slug}.{name}"
        if user_model.objects.filter(username=username).exists():
            raise Conflict(f"an agent named {name!r} already exists in {workspace.slug}")
        user = user_model.objects.create_user(username=username)
        user.set_unusable_password()
        user.save(update_fields=["password"])
        agent = Agent(workspace=workspace, name=name, user=user)
        token = agent.set_new_token()
        agent.save()
        for permission in AGENT_WORKSPACE_PERMISSIONS:
            assign_perm(f"executor.{permission}", user, workspace)
        agent_set_tools(agent=agent, tools=tools)
    return agent, token


def agent_set_tools(*, agent: Agent, tools: Iterable[str] | None) -> list[str]:
    """Makes `tools` exactly the tools the agent may use (every registered one when None).

    Returns their names. An unknown name is refused, naming it, and nothing changes.
    """
    rows = Tool.objects.filter(registered=True)
    if tools is not None:
        wanted = set(tools)
        rows = rows.filter(name__in=wanted)
        unknown = sorted(wanted - {row.name for row in rows})
        if unknown:
            raise Invalid(f"no such tool: {', '.join(unknown)}", {"tools": unknown})
    chosen = list(rows)
    user = agent.user
    with transaction.atomic():
        for row in Tool.objects.exclude(pk__in=[t.pk for t in chosen]):
            remove_perm("executor.use_tool", user, row)
        for row in chosen:
            assign_perm("executor.use_tool", user, row)
    return sorted(row.name for row in chosen)


def agent_set_active(*, agent: Agent, active: bool) -> Agent:
    """Deactivating an agent stops its work at the next claim (its steps become blocked)."""
    Agent.objects.filter(pk=agent.pk).update(is_active=active)
    agent.is_active = active
    return agent


def agent_rotate_token(*, agent: Agent) -> str:
    token = agent.set_new_token()
    agent.save(update_fields=["token_hash", "token_prefix"])
    return token


def reviewer_create(*, workspace: Workspace, username: str, password: str | None = None) -> User:
    """A console user with every reviewer permission on `workspace` (created or updated)."""
    user_model = get_user_model()
    if Agent.objects.filter(user__username=username).exists():
        raise Conflict(f"{username} is an agent's account; it cannot be a reviewer")
    with transaction.atomic():
        user, created = user_model.objects.get_or_create(username=username)
        if password:
            user.set_password(password)
            user.save(update_fields=["password"])
        elif created:
            user.set_unusable_password()
            user.save(update_fields=["password"])
        for permission in REVIEWER_PERMISSIONS:
            assign_perm(f"executor.{permission}", user, workspace)
    return user


def admin_create_first(*, username: str = "admin") -> str | None:
    """A superuser with a random password, when the database has no superuser yet and
    `username` is free. Returns the password, which is stored hashed and never shown
    again; None when nothing was created."""
    user_model = get_user_model()
    with transaction.atomic():
        if user_model.objects.filter(is_superuser=True).exists():
            return None
        if user_model.objects.filter(username=username).exists():
            return None
        password = secrets.token_urlsafe(12)
        user_model.objects.create_superuser(username=username, password=password)
    return password
