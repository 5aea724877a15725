"""`manage.py sweep`: one sweeper pass (what beat runs every few seconds), or a loop."""

from __future__ import annotations

import time
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandParser

from executor import engine
from executor.worker import sweeper


class Command(BaseCommand):
    help = "Recover expired leases, reconcile unknown steps, resend lost messages, pause runs."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--loop", action="store_true", help="sweep until interrupted")

    def handle(self, *args: Any, **options: Any) -> None:
        owner = engine.worker_name()
        while True:
            report = sweeper.sweep(owner=owner)
            if report is None:
                self.stdout.write("another sweeper holds the lease; nothing done")
            else:
                self.stdout.write(" ".join(f"{k}={v}" for k, v in report.as_dict().items()))
            if not options["loop"]:
                return
            time.sleep(settings.EXECUTOR_SWEEP_SECONDS)
