"""Keeps the Tool table in step with the registry after every migrate."""

from __future__ import annotations

from typing import Any

from django.db.models.signals import post_migrate
from django.dispatch import receiver


@receiver(post_migrate)
def sync_tools_after_migrate(sender: Any, **kwargs: Any) -> None:
    if getattr(sender, "name", "") != "executor":
        return
    from executor.services import tools_sync

    tools_sync(using=kwargs.get("using", "default"))
