"""Errors, actors and the checks every write shares."""

from __future__ import annotations

import re
from typing import Any

from django.contrib.auth.models import User

from executor.ledger.records import (
    Agent,
    Workspace,
)


class ServiceError(Exception):
    """A refused request; `code` is the API's error code."""

    code = "invalid"

    def __init__(self, message: str, details: Any = None) -> None:
        super().__init__(message)
        self.message = message
        self.details = details


class NotPermitted(ServiceError):
    code = "forbidden"


class Conflict(ServiceError):
    code = "conflict"


class Invalid(ServiceError):
    code = "invalid_body"


AGENT_NAME = re.compile(r"[A-Za-z0-9._-]{1,60}")


def agent_actor(agent: Agent) -> str:
    return f"agent:{agent.name}"


def user_actor(user: User) -> str:
    return f"user:{user.get_username()}"


class AlreadyHandled(Conflict):
    code = "already_handled"


def require_perm(user: User, permission: str, workspace: Workspace) -> None:
    if not user.is_active or not user.has_perm(f"executor.{permission}", workspace):
        raise NotPermitted(f"you need the {permission} permission on {workspace.slug}")


def require_reason(reason: str) -> str:
    reason = (reason or "").strip()
    if not reason:
        raise Invalid("a decision needs a reason", {"reason": ["required"]})
    return reason[:2000]
