"""`manage.py mcp`: MCP over stdio as the agent whose token is in STEPWARD_TOKEN."""

from __future__ import annotations

import os
from typing import Any

import anyio
from django.core.management.base import BaseCommand, CommandError

from executor.surfaces import api, mcp_server


class Command(BaseCommand):
    help = (
        "Serve the Model Context Protocol on stdin/stdout as the agent whose token is in "
        "STEPWARD_TOKEN (for desktop and CLI agents)."
    )

    def handle(self, *args: Any, **options: Any) -> None:
        token = os.environ.get("STEPWARD_TOKEN", "").strip()
        if not token:
            raise CommandError(
                "STEPWARD_TOKEN is not set: set it to an agent's token "
                "(manage.py create_agent NAME --workspace SLUG prints one)"
            )
        agent = api.agent_for_token(token)
        if agent is None:
            raise CommandError(
                "STEPWARD_TOKEN is not the token of an active agent (rotated, deactivated, or "
                "from another deployment)"
            )
        anyio.run(mcp_server.serve_stdio, agent)
