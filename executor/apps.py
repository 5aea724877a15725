from __future__ import annotations

from django.apps import AppConfig


class ExecutorConfig(AppConfig):
    name = "executor"
    verbose_name = "Ledger"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.conf import settings

        from executor import signals  # noqa: F401
        from executor.common.logcontext import install_record_factory
        from executor.surfaces import limits
        from executor.tools import outbound
        from executor.tools.loader import load_tools

        install_record_factory()
        load_tools(settings.STEPWARD_TOOLS)
        # A malformed limit or allow-list stops startup, naming it, not the first request.
        limits.parse_rate(settings.API_BAD_TOKEN_RATE)
        outbound.allowed_hosts()
