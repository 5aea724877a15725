"""`manage.py archive_runs --older-than 30d [--to DIR] [--dry-run]`: runs with nothing left
to do leave the database with their proof (API.md "Retention", docs/retention.md)."""

from __future__ import annotations

import re
from datetime import timedelta
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from executor.ledger import retention
from executor.ledger.records import Step

UNITS = {"d": "days", "h": "hours", "m": "minutes"}


def age(text: str) -> timedelta:
    """`30d`, `12h`, `90m`, or a number of days."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([dhm]?)\s*", text)
    if match is None:
        raise ValueError(f"{text!r} is not an age like 30d, 12h or 90m")
    return timedelta(**{UNITS[match[2] or "d"]: float(match[1])})


class Command(BaseCommand):
    help = (
        "Archives every run whose steps are all completed, compensated, failed, rejected or "
        "cancelled and that has not changed for --older-than (never a paused run or one with a "
        "step waiting for a person or in flight): writes them to a compressed JSON-lines file "
        "and a manifest signed with the ledger's key, verifies the file, records the runs as "
        "archived in a signed checkpoint, then deletes their rows in small batches."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--older-than", required=True, metavar="AGE", help="e.g. 30d, 12h, 90m (days if bare)"
        )
        parser.add_argument(
            "--to",
            metavar="DIR",
            default=None,
            help=f"where the archives go (default EXECUTOR_ARCHIVE_DIR: "
            f"{settings.EXECUTOR_ARCHIVE_DIR})",
        )
        parser.add_argument(
            "--dry-run", action="store_true", help="say what would move; move nothing"
        )
        parser.add_argument(
            "--batch-size",
            type=int,
            default=retention.DELETE_BATCH,
            help=f"steps deleted per transaction (default {retention.DELETE_BATCH})",
        )
        parser.add_argument(
            "--runs-per-file",
            type=int,
            default=retention.RUNS_PER_FILE,
            help=f"runs in one archive file (default {retention.RUNS_PER_FILE})",
        )
        parser.add_argument("--limit", type=int, help="archive at most this many runs")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            older_than = age(options["older_than"])
        except ValueError as error:
            raise CommandError(f"--older-than: {error}") from None
        for name in ("batch_size", "runs_per_file"):
            if options[name] < 1:
                raise CommandError(f"--{name.replace('_', '-')} must be at least 1")
        if options["limit"] is not None and options["limit"] < 0:
            raise CommandError("--limit must not be negative")
        directory = Path(options["to"] or settings.EXECUTOR_ARCHIVE_DIR)
        now = timezone.now()
        if options["dry_run"]:
            runs = retention.archivable_runs(before=now - older_than)
            count = runs.count()
            steps = Step.objects.filter(run__in=runs).count()
            self.stdout.write(
                f"would archive {count} run(s) ({steps} step(s)) last changed before "
                f"{now - older_than:%Y-%m-%d %H:%M:%S} UTC into {directory}"
            )
            return
        if directory.exists() and not directory.is_dir():
            raise CommandError(f"--to: {directory} is not a directory")
        try:
            report = retention.archive_runs(
                older_than=older_than,
                directory=directory,
                now=now,
                runs_per_file=options["runs_per_file"],
                delete_batch=options["batch_size"],
                limit=options["limit"],
            )
        except (retention.ArchiveError, OSError) as error:
            raise CommandError(str(error)) from None
        for path in report.files:
            self.stdout.write(f"wrote and verified {path}")
        for run_id in report.kept_changed:
            self.stdout.write(f"kept run {run_id}: it changed while it was being archived")
        self.stdout.write(
            self.style.SUCCESS(
                f"archived {report.runs} run(s) ({report.steps} step(s)); "
                f"{report.checkpoints_pruned} checkpoint(s) pruned"
            )
        )
