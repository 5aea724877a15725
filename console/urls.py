from __future__ import annotations

from django.contrib import admin
from django.urls import include, path

from console.metrics import metrics
from console.security import PasswordResetView
from console.signin import SignInCallback, SignInPage, SignInStart
from executor.surfaces.api import api
from executor.surfaces.mcp_server import mcp_http

urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/v1/", api.urls),
    path("metrics", metrics, name="metrics"),
    path("mcp", mcp_http, name="mcp"),
    # Before Django's own: the same URL and name, rate-limited.
    path("accounts/password_reset/", PasswordResetView.as_view(), name="password_reset"),
    # Before Django's own: the same page, offering company sign-in when it is on.
    path("accounts/login/", SignInPage.as_view(), name="login"),
    path("accounts/oidc/start/", SignInStart.as_view(), name="oidc_authentication_init"),
    path("accounts/oidc/callback/", SignInCallback.as_view(), name="oidc_authentication_callback"),
    path("accounts/", include("django.contrib.auth.urls")),
    path("", include("console.console_urls")),
]
