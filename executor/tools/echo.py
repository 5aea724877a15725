"""`echo`: pure; returns its input."""

from __future__ import annotations

from executor.contract.tool import (
    ApprovalRule,
    Effect,
    Idempotency,
    Invocation,
    RetryPolicy,
    Tool,
    ToolResult,
    register,
)


@register
class Echo(Tool):
    name = "echo"
    description = "Returns its input. No side effect."
    effect = Effect.PURE
    idempotency = Idempotency.NONE
    requires_approval = ApprovalRule.NEVER
    compensation = ""
    retry = RetryPolicy(initial_interval=0.5, max_interval=5, max_attempts=3, deadline=60)
    input_schema = {"type": "object"}

    def invoke(self, call: Invocation) -> ToolResult:
        return ToolResult(result=call.input)
