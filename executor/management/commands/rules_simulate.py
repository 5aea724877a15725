"""`manage.py rules_simulate [RULES.toml] [--last 1000] [--workspace SLUG] [--tool NAME]`:
what approval rules would have done to recent calls (API.md "Approval rules")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from executor.ledger.records import Workspace
from executor.policy import simulation
from executor.services.base import Invalid
from executor.services.rules import rules_check
from executor.tools.files import ToolFileError, read_tool_file


class Command(BaseCommand):
    help = (
        "Weighs the workspace's recent calls against the [[rule]] tables of a TOML file (or, "
        "without one, the rules in force) and says which the rules would have sent to a "
        "person or refused. Writes nothing."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("file", nargs="?", help="a TOML file with [[rule]] tables")
        parser.add_argument(
            "--last",
            type=int,
            default=simulation.DEFAULT_LAST,
            help="how many of the most recent calls (default %(default)s)",
        )
        parser.add_argument("--workspace", help="the workspace's slug (default: every one)")
        parser.add_argument("--tool", default="", help="only the calls of this tool")
        parser.add_argument(
            "--all",
            action="store_true",
            help="list every call, not only those sent to a person or refused",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if options["last"] < 1:
            raise CommandError("--last must be at least 1")
        workspace = None
        if options["workspace"]:
            workspace = Workspace.objects.filter(slug=options["workspace"]).first()
            if workspace is None:
                raise CommandError(f"no workspace {options['workspace']!r}")
        rules = None
        source = "the rules in force"
        if options["file"]:
            path = Path(options["file"])
            try:
                file = read_tool_file(path)
                specs = rules_check(file.rules)
            except ToolFileError as error:
                raise CommandError(str(error)) from None
            except Invalid as error:
                for problem in (error.details or {}).get("problems", []):
                    self.stderr.write(self.style.ERROR(problem))
                raise CommandError(f"{path}: {error.message}") from None
            rules = simulation.compiled([spec.row() for spec in specs])
            source = f"the {len(rules)} rule(s) of {path}"
        outcome = simulation.rules_simulate(
            rules=rules, workspace=workspace, tool=options["tool"], last=options["last"]
        )
        where = f"in {workspace.slug}" if workspace else "in every workspace"
        self.stdout.write(f"{len(outcome.calls)} recent call(s) {where}, weighed against {source}:")
        counts = outcome.counts
        for action in ("allow", "require_approval", "require_two", "refuse"):
            self.stdout.write(f"  {action}: {counts.get(action, 0)}")
        self.stdout.write(f"  different from what happened: {len(outcome.changed)}")
        listed = [
            call
            for call in outcome.calls
            if options["all"] or call.to_person or call.would == "refuse"
        ]
        if listed:
            self.stdout.write("")
            self.stdout.write("posted at            | tool | key | would | happened | decided by")
        for call in listed:
            mark = " *" if call.changed else ""
            self.stdout.write(
                f"{call.posted_at:%Y-%m-%d %H:%M:%S} | {call.tool} | {call.key} | "
                f"{call.would}{mark} | {call.happened} | {call.decided_by}"
            )
        for note in outcome.skipped:
            self.stdout.write(self.style.WARNING(f"skipped {note}"))
        if listed and any(call.changed for call in listed):
            self.stdout.write("(* the rules would decide this call differently)")
