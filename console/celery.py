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
# Celery's Django fixup closes every database connection before and after each task unless
# this is set (it reads the name as it stands, not through the namespace): each drain then
# opened a new PostgreSQL backend. The connections are kept for this many tasks instead, and
# Django's own rules (CONN_MAX_AGE, health checks) close an unusable or old one before each
# task (executor/worker/tasks.py).
app.conf.update(CELERY_DB_REUSE_MAX=100)
app.autodiscover_tasks(["executor.worker"])


def ensure_filesystem_broker() -> None:
    """The embedded broker's folders must exist before a worker or a publisher uses them."""
    from django.conf import settings

    if settings.CELERY_BROKER_URL.startswith(("filesystem://", "stepwardfs://")):
        for key in ("data_folder_in", "data_folder_out", "processed_folder", "control_folder"):
            Path(str(settings.CELERY_BROKER_TRANSPORT_OPTIONS[key])).mkdir(
                parents=True, exist_ok=True
            )


ensure_filesystem_broker()
