"""`manage.py record_drill`: records a drill's report (JSON on stdin) in this database.

`manage.py drill --report-to URL` runs it with DATABASE_URL=URL, so a drill on a database of
its own shows on the console's Drills page.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from django.core.management.base import BaseCommand, CommandError
from django.db import DatabaseError

from executor.drill.report import record


class Command(BaseCommand):
    help = "Records a drill report, given as JSON on stdin, in this database."

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            data = json.load(sys.stdin)
        except json.JSONDecodeError as error:
            raise CommandError(f"the report on stdin is not JSON: {error}") from error
        if not isinstance(data, dict):
            raise CommandError("the report on stdin is not a JSON object")
        try:
            report = record(data)
        except (ValueError, TypeError) as error:
            raise CommandError(str(error)) from error
        except DatabaseError as error:
            raise CommandError(
                f"cannot record the report here ({error}); is this database migrated?"
            ) from error
        self.stdout.write(f"recorded as drill {report.pk}")
