"""`manage.py drill`: a recovery drill (DESIGN.md §5, §13) recorded as a DrillReport."""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from executor.drill import (
    BREAKS,
    DEFAULT_DESK_FAULTS,
    DEFAULT_WORKER_FAULTS,
    DrillConfig,
    DrillError,
    parse_desk_faults,
    parse_worker_faults,
    redact_url,
    same_database,
)
from executor.drill.config import current_database_url
from executor.drill.report import as_record, summary_lines
from executor.drill.runner import Drill
from executor.ledger.records import DrillReport


class Command(BaseCommand):
    help = (
        "Runs a recovery drill: starts a ticket desk, a sweeper and worker processes, posts "
        "steps while workers crash at the interruption points and are killed, then checks "
        "every invariant of DESIGN.md §13 and records a DrillReport. Exits non-zero on any "
        "violation. Run it against a drill database, never against production's: its "
        "sweeper acts on every run of the database."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--steps", type=int, default=300, help="steps to post (300)")
        parser.add_argument("--workers", type=int, default=2, help="worker processes (2)")
        parser.add_argument(
            "--batch-size",
            type=int,
            default=10,
            help="steps a worker claims at once (10; a crash strands its whole batch)",
        )
        parser.add_argument(
            "--rates",
            default=DEFAULT_WORKER_FAULTS,
            help=f"worker crash rates per interruption point ({DEFAULT_WORKER_FAULTS})",
        )
        parser.add_argument(
            "--desk-faults",
            default=DEFAULT_DESK_FAULTS,
            help=f"the desk's 503, 429 and dropped-connection rates ({DEFAULT_DESK_FAULTS})",
        )
        parser.add_argument(
            "--kill-every",
            type=float,
            default=10.0,
            metavar="SECONDS",
            help="mean seconds between random SIGKILLs of a worker; 0 for none (10)",
        )
        parser.add_argument(
            "--freeze-every",
            type=float,
            default=15.0,
            metavar="SECONDS",
            help="mean seconds between freezes of a worker (SIGSTOP past its lease, then "
            "SIGCONT); 0 for none (15)",
        )
        parser.add_argument("--seed", type=int, default=None, help="default: a random one")
        parser.add_argument(
            "--compensate",
            type=float,
            default=0.1,
            help="share of completed desk steps a drill reviewer compensates (0.1)",
        )
        parser.add_argument(
            "--database",
            default="",
            metavar="URL",
            help="the ledger to drill (default: DATABASE_URL / settings); workers get it too",
        )
        parser.add_argument(
            "--broker",
            default="",
            metavar="URL",
            help="default: CELERY_BROKER_URL, or an embedded broker in a fresh temp folder",
        )
        parser.add_argument(
            "--timeout",
            type=float,
            default=900.0,
            metavar="SECONDS",
            help="how long to wait for every step to settle (900)",
        )
        parser.add_argument(
            "--report-to",
            default="",
            metavar="URL",
            help="also record the report in this database, e.g. the console's (default with "
            "--database: this settings' own database, so the console's Drills page shows it)",
        )
        parser.add_argument(
            "--tools-file",
            default="",
            metavar="FILE.toml",
            help="HTTP tools ([[tool]] tables, as for load_tools) to load into the drill's "
            "database, pointed at the drill's desk, and post steps to as well",
        )
        parser.add_argument(
            "--tools",
            default="",
            metavar="A,B",
            help="which tools of --tools-file to post to (default: its write tools that are "
            "no other tool's compensation)",
        )
        # Test-only: a deliberately broken engine, to show that the drill can fail.
        parser.add_argument(
            "--upstream",
            choices=["git"],
            default="",
            help="also post commits to mcp-server-git behind the MCP gateway, on a repository "
            "of the drill's own (one commit per step, never two)",
        )
        parser.add_argument("--break", dest="break_engine", choices=BREAKS, help=argparse.SUPPRESS)

    def handle(self, *args: Any, **options: Any) -> None:
        # One line per request to the drill's desk would bury the progress.
        logging.getLogger("httpx").setLevel(logging.WARNING)
        if options["database"] and not same_database(options["database"]):
            self.run_on_other_database(options)
            return
        try:
            config = DrillConfig(
                steps=options["steps"],
                workers=options["workers"],
                batch_size=options["batch_size"],
                worker_faults=parse_worker_faults(options["rates"]),
                desk_faults=parse_desk_faults(options["desk_faults"]),
                kill_every=options["kill_every"],
                freeze_every=options["freeze_every"],
                compensate=options["compensate"],
                broker_url=options["broker"],
                timeout=options["timeout"],
                break_engine=options["break_engine"] or "",
                tools_file=options["tools_file"],
                tools=options["tools"],
                upstream=options["upstream"],
            )
            if options["seed"] is not None:
                config.seed = options["seed"]
            drill = Drill(
                config,
                write=lambda text: self.stdout.write(text, ending=""),
                interactive=self.stdout.isatty(),
            )
            report = drill.run()
        except DrillError as error:
            raise CommandError(str(error)) from error
        for line in summary_lines(report):
            self.stdout.write(line)
        if options["report_to"] and not same_database(options["report_to"]):
            self.record_elsewhere(report, options["report_to"])
        if not report.passed:
            raise CommandError(
                f"drill {report.pk} FAILED: {report.duplicates} duplicates, {report.lost} lost; "
                "every violation is in its notes"
            )

    def run_on_other_database(self, options: dict[str, Any]) -> None:
        """Settings are read once per process: the drill runs in a child on that database."""
        argv = [
            sys.executable,
            str(Path(settings.BASE_DIR) / "manage.py"),
            "drill",
            f"--steps={options['steps']}",
            f"--workers={options['workers']}",
            f"--batch-size={options['batch_size']}",
            f"--rates={options['rates']}",
            f"--desk-faults={options['desk_faults']}",
            f"--kill-every={options['kill_every']}",
            f"--freeze-every={options['freeze_every']}",
            f"--compensate={options['compensate']}",
            f"--timeout={options['timeout']}",
        ]
        if options["seed"] is not None:
            argv.append(f"--seed={options['seed']}")
        if options["broker"]:
            argv.append(f"--broker={options['broker']}")
        if options["break_engine"]:
            argv.append(f"--break={options['break_engine']}")
        if options["tools_file"]:
            # The child runs in BASE_DIR: a relative path would change meaning.
            argv.append(f"--tools-file={Path(options['tools_file']).resolve()}")
        if options["tools"]:
            argv.append(f"--tools={options['tools']}")
        # Beside the console, its Drills page shows the drill: the report is copied here.
        argv.append(f"--report-to={options['report_to'] or current_database_url()}")
        env = {**os.environ, "DATABASE_URL": options["database"]}
        # A drill database of its own starts empty: it gets the ledger's tables first (on
        # one that has them, nothing happens).
        migrated = subprocess.run(  # noqa: S603 - our own interpreter and command
            [sys.executable, str(Path(settings.BASE_DIR) / "manage.py"), "migrate", "--no-input"],
            cwd=settings.BASE_DIR,
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        if migrated.returncode != 0:
            raise CommandError(
                f"the drill's database {redact_url(options['database'])} could not be migrated: "
                + (migrated.stderr.strip().splitlines() or ["no reason given"])[-1]
            )
        child = subprocess.Popen(  # noqa: S603 - our own interpreter and command
            argv,
            cwd=settings.BASE_DIR,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        assert child.stdout is not None
        for line in child.stdout:
            self.stdout.write(line, ending="")
        if child.wait() != 0:
            raise CommandError(f"the drill on {redact_url(options['database'])} failed")

    def record_elsewhere(self, report: DrillReport, url: str) -> None:
        """Copies the report into the database at `url` (`manage.py record_drill` there)."""
        result = subprocess.run(  # noqa: S603 - our own interpreter and command
            [sys.executable, str(Path(settings.BASE_DIR) / "manage.py"), "record_drill"],
            cwd=settings.BASE_DIR,
            env={**os.environ, "DATABASE_URL": url},
            input=json.dumps(as_record(report)),
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode != 0:
            raise CommandError(
                f"the drill ran, but its report could not be recorded in {redact_url(url)}: "
                + (result.stderr.strip().splitlines() or ["no reason given"])[-1]
            )
        self.stdout.write(f"{result.stdout.strip()} in {redact_url(url)}")
