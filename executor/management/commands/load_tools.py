"""`manage.py load_tools FILE.toml [--check] [--prune]`: HTTP tools as data (API.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from executor import services
from executor.tools import http as http_tools


class Command(BaseCommand):
    help = (
        "Creates or updates the HTTP tools of a TOML file ([[tool]] tables, API.md 'Your own "
        "tools'), all or nothing. --check validates and says what would change, writing "
        "nothing; --prune also removes the HTTP tools the file does not name."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("file", help="the TOML file")
        parser.add_argument("--check", action="store_true", help="validate only; write nothing")
        parser.add_argument(
            "--prune", action="store_true", help="remove HTTP tools the file does not name"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        path = Path(options["file"])
        try:
            tables = http_tools.read_tool_file(path)
        except http_tools.ToolFileError as error:
            raise CommandError(str(error)) from None
        try:
            report = services.http_tools_load(
                tables=tables, prune=options["prune"], check=options["check"]
            )
        except services.Invalid as error:
            for problem in (error.details or {}).get("problems", []):
                self.stderr.write(self.style.ERROR(problem))
            raise CommandError(f"{path}: {error.message}") from None
        verb = "would be" if options["check"] else "were"
        for label, names in (
            ("created", report.created),
            ("updated (a new policy version: earlier approvals no longer hold)", report.updated),
            ("unchanged", report.unchanged),
            ("removed", report.removed),
        ):
            if names:
                self.stdout.write(f"{len(names)} {verb} {label}: {', '.join(names)}")
        if options["check"]:
            self.stdout.write(self.style.SUCCESS(f"{path}: valid; nothing was written"))
        else:
            self.stdout.write(self.style.SUCCESS(f"{path}: loaded"))
