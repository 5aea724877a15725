from __future__ import annotations

from django.contrib import admin
from django.urls import include, path

from console.metrics import metrics
from executor.api import api

urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/v1/", api.urls),
    path("metrics", metrics, name="metrics"),
    path("accounts/", include("django.contrib.auth.urls")),
    path("", include("console.console_urls")),
]
