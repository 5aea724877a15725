"""The Django project and the reviewers' console."""

from __future__ import annotations

from console.celery import app as celery_app

__all__ = ["celery_app"]
