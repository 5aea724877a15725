"""`manage.py load_tools FILE.toml [--check] [--prune] [--no-connect]`: HTTP tools, MCP
upstreams and approval rules as data (API.md "Your own tools", "MCP gateway", "Approval
rules")."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from executor.contract.tool import find_tool
from executor.services.base import Invalid
from executor.services.rules import RulesLoaded, rules_check, rules_load
from executor.services.tools import tools_load
from executor.tools.files import ToolFileError, read_tool_file, unset_variables


class Command(BaseCommand):
    help = (
        "Creates or updates the HTTP tools ([[tool]] tables) and MCP upstreams ([[upstream]] "
        "tables) of a TOML file (API.md), all or nothing, and asks each upstream for its "
        "tools; its [[rule]] tables, if any, become the approval rules. --check validates "
        "and says what would change, writing nothing; --prune also "
        "removes the HTTP tools and upstreams the file does not name (of the kinds it holds)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("file", help="the TOML file")
        parser.add_argument("--check", action="store_true", help="validate only; write nothing")
        parser.add_argument(
            "--prune",
            action="store_true",
            help="remove the HTTP tools (if the file has [[tool]]s) and the upstreams (if it "
            "has [[upstream]]s) the file does not name",
        )
        parser.add_argument(
            "--no-connect",
            action="store_true",
            help="do not ask the upstreams for their tools now (the workers will)",
        )
        parser.add_argument(
            "--no-env-check",
            action="store_true",
            help="load even when a ${NAME} the file reads is not set here (only the workers' "
            "environment holds it)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        path = Path(options["file"])
        try:
            file = read_tool_file(path)
        except ToolFileError as error:
            raise CommandError(str(error)) from None
        unset = [] if options["no_env_check"] else unset_variables(file, os.environ)
        if unset:
            for problem in unset:
                self.stderr.write(self.style.ERROR(problem))
            raise CommandError(
                f"{path}: {len(unset)} variable(s) not set; nothing was loaded. The workers read "
                "each ${NAME} from their environment at every call: set it there and here "
                "(--no-env-check loads without it, where only the workers hold it)."
            )
        try:
            # The rules are checked before anything is written: all or nothing.
            if file.rules:
                rules_check(file.rules)
            report = tools_load(
                tables=file.tools,
                upstreams=file.upstreams,
                prune=options["prune"],
                check=options["check"],
                connect=not options["no_connect"],
            )
            rules = rules_load(tables=file.rules, check=options["check"]) if file.rules else None
        except Invalid as error:
            for problem in (error.details or {}).get("problems", []):
                self.stderr.write(self.style.ERROR(problem))
            raise CommandError(f"{path}: {error.message}") from None
        if rules is not None:
            self._say_rules(rules, check=options["check"])
        new_version = " (a new policy version: earlier approvals no longer hold)"
        for noun, done, names in (
            ("tool", "created", report.created),
            ("tool", "updated" + new_version, report.updated),
            ("tool", "unchanged", report.unchanged),
            ("tool", "removed", report.removed),
            ("upstream", "created", report.upstreams_created),
            ("upstream", "updated" + new_version, report.upstreams_updated),
            ("upstream", "unchanged", report.upstreams_unchanged),
            ("upstream", "removed", report.upstreams_removed),
        ):
            if names:
                many = len(names) != 1
                verb = "would be" if options["check"] else ("were" if many else "was")
                count = f"{len(names)} {noun}{'s' if many else ''}"
                self.stdout.write(f"{count} {verb} {done}: {', '.join(names)}")
        for listed in report.listed:
            if listed.error:
                self.stdout.write(
                    self.style.WARNING(
                        f"upstream {listed.upstream}: not listed from here ({listed.error}); "
                        "the workers list its tools when they reach it"
                    )
                )
                continue
            self.stdout.write(
                f"upstream {listed.upstream}: {len(listed.tools)} tool(s): "
                f"{', '.join(listed.tools) or 'none'}"
            )
            for name in listed.taken:
                self.stdout.write(
                    self.style.WARNING(
                        f"upstream {listed.upstream}: {name} is the name of another tool, "
                        "which keeps it: not registered"
                    )
                )
            for entry in listed.unknown_entries:
                self.stdout.write(
                    self.style.WARNING(
                        f"upstream {listed.upstream}: [upstream.tools.{entry}] names a tool "
                        "it does not list"
                    )
                )
        if options["check"]:
            self.stdout.write(self.style.SUCCESS(f"{path}: valid; nothing was written"))
        else:
            self.stdout.write(self.style.SUCCESS(f"{path}: loaded"))

    def _say_rules(self, rules: RulesLoaded, *, check: bool) -> None:
        count = f"{len(rules.rules)} rule{'s' if len(rules.rules) != 1 else ''}"
        if not rules.changed:
            self.stdout.write(f"{count}: unchanged")
            return
        verb = "would replace" if check else "replaced"
        self.stdout.write(
            f"{count} {verb} the {rules.removed} before (a new policy version: approvals "
            "given under the old rules no longer hold)"
        )
        for spec in rules.rules:
            where = spec.workspace.slug if spec.workspace else "every workspace"
            self.stdout.write(
                f"  #{spec.position} {spec.tool} in {where}: {spec.action} when {spec.when}"
            )
            if spec.tool != "*" and find_tool(spec.tool) is None:
                self.stdout.write(
                    self.style.WARNING(
                        f"  rule #{spec.position} names {spec.tool}, which is not a registered "
                        "tool here: it applies once a tool of that name is"
                    )
                )
