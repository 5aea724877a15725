"""The public import path for tool authors (API.md "Your own tools").

    from executor.tools import Effect, Idempotency, Invocation, Tool, ToolResult, register

One module per tool registers `Tool` subclasses with `@register`; STEPWARD_TOOLS names the
modules every process imports at startup. `base` holds the contract and the registry.
"""

from __future__ import annotations

from executor.contract.tool import (
    ApprovalRule,
    Effect,
    FailureClass,
    Idempotency,
    Invocation,
    Lookup,
    LookupOutcome,
    RetryPolicy,
    Tool,
    ToolError,
    ToolResult,
    register,
)

__all__ = [
    "ApprovalRule",
    "Effect",
    "FailureClass",
    "Idempotency",
    "Invocation",
    "Lookup",
    "LookupOutcome",
    "RetryPolicy",
    "Tool",
    "ToolError",
    "ToolResult",
    "register",
]
