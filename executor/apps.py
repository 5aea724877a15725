from __future__ import annotations

from django.apps import AppConfig


class ExecutorConfig(AppConfig):
    name = "executor"
    verbose_name = "Ledger"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from executor import signals  # noqa: F401
