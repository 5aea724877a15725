"""`manage.py tool_policy WORKSPACE TOOL --approval always|never|by_policy|default`."""

from __future__ import annotations

from decimal import Decimal, InvalidOperation
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from executor.ledger.records import Workspace
from executor.services.base import ServiceError
from executor.services.tools import tool_policy_set


class Command(BaseCommand):
    help = (
        "Sets whether a person approves each call of a tool in a workspace: always, never, "
        "by_policy (destructive effects, irreversible writes and, with --cost-above, costly "
        "calls need a person), or default (the tool's own declaration). Approvals given "
        "under the earlier policy no longer authorize anything."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("workspace", help="the workspace's slug")
        parser.add_argument("tool", help="the tool's name")
        parser.add_argument(
            "--approval", required=True, choices=["always", "never", "by_policy", "default"]
        )
        parser.add_argument(
            "--destructive",
            action="store_true",
            default=None,
            help="by_policy: destructive effects need a person (the default)",
        )
        parser.add_argument("--no-destructive", dest="destructive", action="store_false")
        parser.add_argument(
            "--irreversible",
            action="store_true",
            default=None,
            help="by_policy: writes nothing can undo need a person (the default)",
        )
        parser.add_argument("--no-irreversible", dest="irreversible", action="store_false")
        parser.add_argument(
            "--cost-above", metavar="AMOUNT", help="by_policy: calls estimated above it too"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        workspace = Workspace.objects.filter(slug=options["workspace"]).first()
        if workspace is None:
            raise CommandError(f"no workspace {options['workspace']!r}")
        cost_above = None
        if options["cost_above"] is not None:
            try:
                cost_above = Decimal(options["cost_above"])
            except InvalidOperation:
                raise CommandError("--cost-above is not a number") from None
        try:
            policy = tool_policy_set(
                workspace=workspace,
                tool=options["tool"],
                approval=options["approval"],
                destructive=options["destructive"] is not False,
                irreversible=options["irreversible"] is not False,
                cost_above=cost_above,
            )
        except ServiceError as error:
            raise CommandError(error.message) from None
        if policy is None:
            self.stdout.write(
                f"{options['tool']} in {workspace.slug}: the tool's own declaration holds."
            )
            return
        rules = []
        if policy.approval == "by_policy":
            rules = [
                name
                for name, on in (
                    ("destructive effects", policy.destructive),
                    ("irreversible writes", policy.irreversible),
                    (f"calls estimated above {policy.cost_above}", policy.cost_above is not None),
                )
                if on
            ]
        detail = f" ({', '.join(rules)} need a person)" if rules else ""
        self.stdout.write(
            f"{options['tool']} in {workspace.slug}: approval {policy.approval}{detail}."
        )
