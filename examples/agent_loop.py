"""A ten-line agent: a stand-in "model" picks each next tool call, Stepward runs it durably.

With `make run` going: STEPWARD_TOKEN=<the token it printed> python examples/agent_loop.py
(STEPWARD_URL defaults to http://127.0.0.1:8000). Run it twice: the run key and step keys
come from the task, so the second time finds every step done and nothing happens twice.
"""

from __future__ import annotations

import os
from typing import Any

from stepward_client import Step, Stepward


def model(history: list[Step]) -> tuple[str, dict[str, Any]] | None:
    """Stands in for an LLM: the next tool call given what happened so far, or None."""
    if not history:
        return "echo", {"message": "Printer on floor 3 jams"}
    if len(history) == 1 and history[0].state == "completed":
        return "ticketdesk.create", {"title": history[0].result["message"]}
    return None


URL = os.environ.get("STEPWARD_URL", "http://127.0.0.1:8000")
with Stepward(URL, os.environ["STEPWARD_TOKEN"]) as client:
    run = client.run("agent loop", key="agent-loop-printer")
    history: list[Step] = []
    while (call := model(history)) is not None:
        tool, tool_input = call
        step = run.step(f"turn-{len(history)}", tool, tool_input).wait(timeout=120)
        print(f"{tool}: {step.state} {step.result or step.failure}")
        history.append(step)
    print(run.report().summary)
