"""The Celery app (`celery -A console worker` / `celery -A console beat`)."""

from __future__ import annotations

import os
from pathlib import Path

from celery import Celery
from kombu.transport import TRANSPORT_ALIASES

# The embedded broker (console/broker.py), by a scheme name kombu resolves.
TRANSPORT_ALIASES.setdefault("stepwardfs", "console.broker:Transport")

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")

app = Celery("console")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(["executor"])


def ensure_filesystem_broker() -> None:
    """The embedded broker's folders must exist before a worker or a publisher uses them."""
    from django.conf import settings

    if settings.CELERY_BROKER_URL.startswith(("filesystem://", "stepwardfs://")):
        for key in ("data_folder_in", "data_folder_out", "processed_folder", "control_folder"):
            Path(str(settings.CELERY_BROKER_TRANSPORT_OPTIONS[key])).mkdir(
                parents=True, exist_ok=True
            )


ensure_filesystem_broker()
