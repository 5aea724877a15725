from __future__ import annotations

from django.contrib import admin
from django.urls import include, path

from console.metrics import metrics
from console.security import PasswordResetView
from executor.api import api
from executor.mcp_server import mcp_http

urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/v1/", api.urls),
    path("metrics", metrics, name="metrics"),
    path("mcp", mcp_http, name="mcp"),
    # Before Django's own: the same URL and name, rate-limited.
    path("accounts/password_reset/", PasswordResetView.as_view(), name="password_reset"),
    path("accounts/", include("django.contrib.auth.urls")),
    path("", include("console.console_urls")),
]
