from __future__ import annotations

from django.contrib import admin
from django.urls import include, path

from console.metrics import metrics
from executor.api import api
from executor.mcp_server import mcp_http

urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/v1/", api.urls),
    path("metrics", metrics, name="metrics"),
    path("mcp", mcp_http, name="mcp"),
    path("accounts/", include("django.contrib.auth.urls")),
    path("", include("console.console_urls")),
]
