"""Keeps the Tool table in step with the registry after every migrate."""

from __future__ import annotations

from typing import Any

from django.db.models.signals import post_delete, post_migrate
from django.dispatch import receiver


@receiver(post_migrate)
def sync_tools_after_migrate(sender: Any, **kwargs: Any) -> None:
    if getattr(sender, "name", "") != "executor":
        return
    from executor.services import tools_sync

    tools_sync(using=kwargs.get("using", "default"))


@receiver(post_delete, sender="executor.SignInRole")
def delete_role_group(sender: Any, instance: Any, **kwargs: Any) -> None:
    """A mapping removed in the admin takes its role from everyone who held it, at once."""
    from django.contrib.auth.models import Group

    Group.objects.filter(pk=instance.group_id).delete()


@receiver(post_migrate)
def notification_triggers_after_migrate(sender: Any, **kwargs: Any) -> None:
    """Puts back the notification triggers where a migration rebuilt their table (SQLite
    rebuilds a table to alter it, and drops its triggers with it)."""
    if getattr(sender, "name", "") != "executor":
        return
    from django.db import connections

    from executor import triggers

    connection = connections[kwargs.get("using", "default")]
    if "executor_notification" in connection.introspection.table_names():
        triggers.install(connection)
