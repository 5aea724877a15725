"""`manage.py create_agent NAME --workspace SLUG`: an agent and its token (API.md)."""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.core.validators import validate_slug
from django.db import transaction

from executor.ledger.records import Agent, Tool, ToolUserObjectPermission, Workspace
from executor.services.accounts import agent_create, workspace_get_or_create
from executor.services.base import ServiceError


class Command(BaseCommand):
    help = (
        "Creates an agent (and its workspace if needed) with submit_steps on the workspace "
        "and use_tool on the tools named by --tools (every tool by default). Prints its "
        "token alone on the last line: it is shown only this once."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name", help="the agent's name, unique within its workspace")
        parser.add_argument("--workspace", required=True, metavar="SLUG")
        which = parser.add_mutually_exclusive_group()
        which.add_argument(
            "--tools",
            metavar="A,B",
            help="the tools it may use (use_tool), comma-separated; default: every tool",
        )
        which.add_argument(
            "--all-tools", action="store_true", help="use_tool on every tool (the default)"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        name: str = options["name"].strip()
        slug: str = options["workspace"]
        _validate(name=name, slug=slug)
        new_workspace = not Workspace.objects.filter(slug=slug).exists()
        try:
            # One transaction: a refused agent leaves no workspace created for it behind.
            with transaction.atomic():
                workspace = workspace_get_or_create(slug=slug)
                agent, token = agent_create(
                    workspace=workspace, name=name, tools=_tools(options["tools"])
                )
        except ServiceError as error:
            raise CommandError(error.message) from None
        usable = ", ".join(
            Tool.objects.filter(registered=True)
            .filter(pk__in=agent_tools(agent))
            .values_list("name", flat=True)
        )
        self.stdout.write(
            f"Created agent {agent.name!r} in {'new' if new_workspace else 'existing'} "
            f"workspace {workspace.slug!r} with submit_steps on the workspace and use_tool on: "
            f"{usable or 'no tool'}. Its token follows; it is not stored and will not be shown "
            "again:"
        )
        # Alone on the last line, so scripts can take it with `tail -n 1`.
        self.stdout.write(token)


def _tools(option: str | None) -> list[str] | None:
    if option is None:
        return None
    names = [name.strip() for name in option.split(",") if name.strip()]
    if not names:
        raise CommandError("--tools names no tool")
    return names


def agent_tools(agent: Agent) -> list[int]:
    """The Tool rows the agent holds use_tool on."""
    return list(
        ToolUserObjectPermission.objects.filter(
            user=agent.user, permission__codename="use_tool"
        ).values_list("content_object_id", flat=True)
    )


def _validate(*, name: str, slug: str) -> None:
    try:
        validate_slug(slug)
    except ValidationError:
        raise CommandError(
            f"--workspace {slug!r} is not a slug (letters, digits, hyphens, underscores)"
        ) from None
    slug_max = Workspace._meta.get_field("slug").max_length
    if slug_max is not None and len(slug) > slug_max:
        raise CommandError(f"--workspace is longer than {slug_max} characters")
    if not name:
        raise CommandError("the agent's name must not be empty")
    name_max = Agent._meta.get_field("name").max_length
    if name_max is not None and len(name) > name_max:
        raise CommandError(f"the agent's name is longer than {name_max} characters")
