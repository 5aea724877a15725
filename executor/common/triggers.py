"""Database triggers installed by migrations and put back by every `migrate` (SQLite drops a
table's triggers when a later migration rebuilds the table): the statements for each
database, and the names to look them up by."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TriggerSet:
    what: str
    # Per vendor: the statements that create (or replace) them, those that drop them, and
    # the triggers' names.
    create: dict[str, list[str]]
    drop: dict[str, list[str]]
    names: dict[str, tuple[str, ...]]

    def _statements(self, vendor: str, *, remove: bool = False) -> list[str]:
        found = (self.drop if remove else self.create).get(vendor)
        if found is None:
            raise RuntimeError(f"{self.what} are written for PostgreSQL and SQLite, not {vendor}")
        return found

    def _execute(self, connection: Any, statements: list[str]) -> None:
        with connection.cursor() as cursor:
            for sql in statements:
                cursor.execute(sql)

    def install(self, connection: Any) -> None:
        """Creates the triggers, or replaces them with these."""
        self._execute(connection, self._statements(connection.vendor))

    def uninstall(self, connection: Any) -> None:
        self._execute(connection, self._statements(connection.vendor, remove=True))

    def installed(self, connection: Any) -> set[str]:
        """The names of the triggers of this set that the database has."""
        names = list(self.names[connection.vendor])
        with connection.cursor() as cursor:
            if connection.vendor == "postgresql":
                cursor.execute(
                    "SELECT tgname FROM pg_trigger WHERE NOT tgisinternal AND tgname = ANY(%s)",
                    [names],
                )
            else:
                marks = ", ".join(["%s"] * len(names))
                cursor.execute(
                    f"SELECT name FROM sqlite_master WHERE type = 'trigger' AND name IN ({marks})",  # noqa: S608 - placeholders
                    names,
                )
            return {row[0] for row in cursor.fetchall()}
