"""Tools come from the modules STEPWARD_TOOLS names (API.md "Your own tools"): every process
imports them at startup, and one that cannot be imported or breaks the contract stops the
start with a message naming it. `executor.tools` is the public import path for authors."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import executor.tools
from executor.ledger import records

ROOT = Path(__file__).resolve().parents[2]
PUBLIC_NAMES = (
    "Tool",
    "register",
    "Invocation",
    "ToolResult",
    "ToolError",
    "FailureClass",
    "RetryPolicy",
    "Lookup",
    "LookupOutcome",
    "Effect",
    "Idempotency",
    "ApprovalRule",
)


def start(tmp_path: Path, tools: str) -> subprocess.CompletedProcess[str]:
    """`manage.py check` (a process starting up) with STEPWARD_TOOLS set to `tools`."""
    env = {
        **os.environ,
        "STEPWARD_TOOLS": tools,
        "PYTHONPATH": str(tmp_path),
        "STEPWARD_VAR_DIR": str(tmp_path / "var"),
        "SECRET_KEY": "a-test-key-that-is-long-enough-for-anything-0123456789",
    }
    env.pop("DATABASE_URL", None)
    return subprocess.run(
        [sys.executable, "manage.py", "check"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_public_import_path_has_every_name_api_md_lists() -> None:
    assert all(hasattr(executor.tools, name) for name in PUBLIC_NAMES)
    assert set(executor.tools.__all__) == set(PUBLIC_NAMES)


def test_the_records_take_their_vocabulary_from_the_tool_contract() -> None:
    assert records.Effect is executor.tools.Effect
    assert records.Idempotency is executor.tools.Idempotency
    assert records.ApprovalRule is executor.tools.ApprovalRule


def test_a_module_of_good_tools_loads(tmp_path: Path) -> None:
    (tmp_path / "good_tools.py").write_text(
        textwrap.dedent(
            """
            from executor.tools import (
                ApprovalRule, Effect, Idempotency, RetryPolicy, Tool, ToolResult, register,
            )

            @register
            class Shout(Tool):
                name = "good.shout"
                effect = Effect.PURE
                idempotency = Idempotency.NONE
                requires_approval = ApprovalRule.NEVER
                compensation = ""
                retry = RetryPolicy()
                input_schema = {"type": "object"}

                def invoke(self, call):
                    return ToolResult(result={k: str(v).upper() for k, v in call.input.items()})
            """
        )
    )

    started = start(tmp_path, "executor.tools.builtins,good_tools")

    assert started.returncode == 0, started.stderr


def test_a_module_that_cannot_be_imported_stops_startup_naming_it(tmp_path: Path) -> None:
    started = start(tmp_path, "executor.tools.builtins,no_such_tools")

    assert started.returncode != 0
    assert "STEPWARD_TOOLS: the tool module 'no_such_tools' could not be imported" in (
        started.stderr
    )


def test_a_tool_that_breaks_the_contract_stops_startup_naming_it(tmp_path: Path) -> None:
    (tmp_path / "broken_tools.py").write_text(
        textwrap.dedent(
            """
            from executor.tools import Effect, Idempotency, Tool, register

            @register
            class Forgetful(Tool):
                name = "broken.forgetful"
                effect = Effect.WRITE
                idempotency = Idempotency.NONE

                def invoke(self, call):
                    raise NotImplementedError
            """
        )
    )

    started = start(tmp_path, "executor.tools.builtins,broken_tools")

    assert started.returncode != 0
    assert "STEPWARD_TOOLS: broken_tools: tool Forgetful does not declare" in started.stderr
    assert "requires_approval" in started.stderr
