"""`manage.py verify_ledger [--step UUID]`: checks every step's Event hash chain."""

from __future__ import annotations

import uuid
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from executor.ledger import DEFAULT_CHUNK_SIZE, verify_chain
from executor.models import Step


class Command(BaseCommand):
    help = (
        "Verifies the hash chain of each step's events and reports the first broken link of "
        "every broken step. Exits non-zero when anything is broken."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--step", help="verify only this step (its UUID)")
        parser.add_argument(
            "--chunk-size",
            type=int,
            default=DEFAULT_CHUNK_SIZE,
            help=f"steps read per round trip (default {DEFAULT_CHUNK_SIZE})",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        step_ids = None
        if options["step"]:
            try:
                step_id = uuid.UUID(options["step"])
            except ValueError:
                raise CommandError(f"--step: {options['step']!r} is not a UUID") from None
            if not Step.objects.filter(pk=step_id).exists():
                raise CommandError(f"no step {step_id}")
            step_ids = [step_id]
        if options["chunk_size"] < 1:
            raise CommandError("--chunk-size must be at least 1")

        report = verify_chain(step_ids=step_ids, chunk_size=options["chunk_size"])
        for finding in report.findings:
            self.stdout.write(self.style.ERROR(str(finding)))
        summary = report.summary()
        if not report.ok:
            self.stdout.write(summary)
            raise CommandError(f"the ledger is broken: {len(report.findings)} step(s) failed")
        self.stdout.write(self.style.SUCCESS(summary))
