"""Hot tables stay healthy (issue 25.2): per-table vacuum and analyze thresholds and room on
their pages, and `check --deploy` says when the server's autovacuum is off."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
from django.core.checks import run_checks
from django.db import DEFAULT_DB_ALIAS, connection, connections

from executor.ledger import checks

pytestmark = pytest.mark.django_db

migration = importlib.import_module("executor.migrations.0019_page_indexes_and_hot_tables")


def options_of(table: str) -> dict[str, str]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT reloptions FROM pg_class WHERE relname = %s", [table])
        (options,) = cursor.fetchone()
    return dict(option.split("=", 1) for option in options or [])


@pytest.mark.postgres
@pytest.mark.parametrize("table", sorted(migration.HOT_TABLES))
def test_each_table_updated_at_every_move_has_its_own_thresholds(table: str) -> None:
    wanted = {name: str(value) for name, value in migration.HOT_TABLES[table].items()}

    assert options_of(table) == wanted
    assert "autovacuum_vacuum_threshold" in wanted or table == "executor_event"


@pytest.mark.postgres
def test_check_deploy_warns_when_the_servers_autovacuum_is_off() -> None:
    with connection.cursor() as cursor:
        cursor.execute("SHOW autovacuum")
        (autovacuum,) = cursor.fetchone()

    found = [m for m in run_checks(include_deployment_checks=True) if m.id == "stepward.W001"]

    # This machine's server runs with it off (a CI setting); a deployment's with it on.
    assert [m.msg.split(":")[0] for m in found] == (
        ["PostgreSQL's autovacuum is off on this server"] if autovacuum == "off" else []
    )
    assert not [m for m in run_checks() if m.id == "stepward.W001"]  # a deploy check only


@pytest.mark.postgres
def test_the_check_reads_the_servers_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    wrapper = connections[DEFAULT_DB_ALIAS]
    real = wrapper.cursor

    class Settings:
        """A cursor whose server answers autovacuum and track_counts as given."""

        def __init__(self, answer: tuple[str, str]) -> None:
            self.answer = answer

        def __enter__(self) -> Settings:
            return self

        def __exit__(self, *exc: Any) -> None:
            pass

        def execute(self, sql: str, params: Any = None) -> None:
            with real() as cursor:  # the statement must run as written
                cursor.execute(sql, params)

        def fetchone(self) -> tuple[str, str]:
            return self.answer

    monkeypatch.setattr(wrapper, "cursor", lambda: Settings(("on", "on")))
    assert checks.autovacuum_on() == []
    monkeypatch.setattr(wrapper, "cursor", lambda: Settings(("on", "off")))
    assert "track_counts is off" in checks.autovacuum_on()[0].msg


def test_no_warning_where_there_is_no_autovacuum_to_have(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(connections[DEFAULT_DB_ALIAS], "vendor", "sqlite")

    assert checks.autovacuum_on() == []
