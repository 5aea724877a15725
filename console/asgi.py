"""ASGI entry point: `gunicorn console.asgi -k uvicorn_worker.UvicornWorker` (README,
"Production"). Long-polls wait on the event loop, holding no thread and no connection, a slow
request body costs a coroutine until REQUEST_BODY_SECONDS end it, and PostgreSQL
connections come from a pool (console/serving.py)."""

from __future__ import annotations

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")

from django.conf import settings
from django.core.asgi import get_asgi_application

from console.serving import BodyDeadline, pooled

# Before anything connects: connections are made from the settings at first use.
settings.DATABASES["default"] = pooled(settings.DATABASES["default"])  # type: ignore[arg-type,assignment]
application = BodyDeadline(get_asgi_application())
