"""Keeps the Tool table in step with the registry and puts back the notification triggers
after every migrate, removes a deleted sign-in role's group, and checks NOTIFY_URLS."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core import checks
from django.db.models.signals import post_delete, post_migrate
from django.dispatch import receiver


@receiver(post_migrate)
def sync_tools_after_migrate(sender: Any, **kwargs: Any) -> None:
    if getattr(sender, "name", "") != "executor":
        return
    from executor.services.tools import tools_sync

    tools_sync(using=kwargs.get("using", "default"))


@receiver(post_delete, sender="executor.SignInRole")
def delete_role_group(sender: Any, instance: Any, **kwargs: Any) -> None:
    """A mapping removed in the admin takes its role from everyone who held it, at once."""
    from django.contrib.auth.models import Group

    Group.objects.filter(pk=instance.group_id).delete()


@receiver(post_migrate)
def notification_triggers_after_migrate(sender: Any, **kwargs: Any) -> None:
    """Puts back the notification triggers and the ledger's guards where a migration rebuilt
    their table (SQLite rebuilds a table to alter it, and drops its triggers with it)."""
    if getattr(sender, "name", "") != "executor":
        return
    from django.db import connections
    from django.db.migrations.recorder import MigrationRecorder

    from executor.ledger import guards
    from executor.notifications import triggers

    connection = connections[kwargs.get("using", "default")]
    tables = connection.introspection.table_names()
    if "executor_notification" in tables:
        triggers.install(connection)
    if ("executor", guards.MIGRATION) in MigrationRecorder(connection).applied_migrations():
        guards.install(connection)


@checks.register("notifications")
def notify_urls_check(app_configs: Any, **kwargs: Any) -> list[checks.CheckMessage]:
    """A NOTIFY_URLS entry Apprise cannot send to stops startup, named (masked) and numbered,
    rather than fail at every sweep."""
    from executor.notifications import outbox

    found: list[checks.CheckMessage] = []
    for number, url in enumerate(settings.NOTIFY_URLS, start=1):
        problem = outbox.url_problem(url)
        if problem:
            found.append(
                checks.Error(
                    f"NOTIFY_URLS entry {number} ({outbox.masked(url)}): {problem}",
                    id="stepward.E101",
                )
            )
        elif outbox.scheme_of(url) in outbox.WEBHOOK_SCHEMES and not settings.NOTIFY_SIGNING_KEY:
            found.append(
                checks.Warning(
                    f"NOTIFY_URLS entry {number} is a JSON webhook and NOTIFY_SIGNING_KEY is "
                    "not set: it will not be sent (never unsigned).",
                    id="stepward.W101",
                )
            )
    return found
