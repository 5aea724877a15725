"""`manage.py ticketdesk`: runs the harmless external ticket desk in this process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from executor.desk.ticketdesk import TicketDeskServer, serve


class Command(BaseCommand):
    help = "Runs the ticket desk (own process, own SQLite file) until SIGTERM or SIGINT."
    # The desk never touches the project's database, so it must start even where the
    # project's checks would fail.
    requires_system_checks: list[str] = []

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument(
            "--port",
            type=int,
            default=settings.TICKETDESK_PORT,
            help="default TICKETDESK_PORT (8765); 0 picks a free port",
        )
        parser.add_argument(
            "--db", default=None, help="SQLite file (default: VAR_DIR/ticketdesk.sqlite3)"
        )
        parser.add_argument("--quiet", action="store_true", help="no access log on stderr")

    def handle(self, *args: Any, **options: Any) -> None:
        db_path = Path(options["db"] or settings.VAR_DIR / "ticketdesk.sqlite3")
        db_path.parent.mkdir(parents=True, exist_ok=True)

        def ready(server: TicketDeskServer) -> None:
            self.stdout.write(f"ticketdesk listening on {server.url} (db {db_path})")
            # Whoever started us may be waiting for this line on a pipe or a file.
            self.stdout.flush()

        try:
            serve(
                options["host"], options["port"], str(db_path), quiet=options["quiet"], ready=ready
            )
        except OSError as error:
            raise CommandError(
                f"cannot serve on {options['host']}:{options['port']}: {error}"
            ) from error
        self.stdout.write("ticketdesk stopped")
