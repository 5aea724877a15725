"""PostgreSQL-only helpers for tests that end other sessions on the test database."""

from __future__ import annotations

from django.db import connection


def end_backends(condition: str) -> list[bool]:
    """Ends every other backend on the test database that matches `condition` (SQL over
    pg_stat_activity), waiting up to 10 s for each to be gone; one result per backend."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pg_terminate_backend(pid, 10000) FROM pg_stat_activity "
            f"WHERE datname = current_database() AND pid <> pg_backend_pid() AND ({condition})"
        )
        return [row[0] for row in cursor.fetchall()]
