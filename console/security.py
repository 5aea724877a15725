"""What the web process adds for safety beyond Django's own: pages no cache keeps, the client
address that sign-in throttling counts failures by, and a password reset that cannot be used
to flood a mailbox."""

from __future__ import annotations

import hashlib
import math
from typing import Any

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.conf import settings
from django.contrib.auth import views as auth_views
from django.contrib.auth.forms import PasswordResetForm
from django.http import HttpRequest, HttpResponse, HttpResponseBase
from django.utils.cache import add_never_cache_headers

from executor.surfaces import limits


class NoStoreMiddleware:
    """`Cache-Control: no-store` (with Django's other never-cache headers) on every response
    that has not said how it may be cached: console pages show ledger data and decisions,
    which neither a shared proxy nor the browser's back button should keep.

    Static files are answered by whitenoise above this middleware and keep their caching.
    Sync and async: under ASGI it passes a long-poll's await through without a thread.
    """

    sync_capable = True
    async_capable = True

    def __init__(self, get_response: Any) -> None:
        self.get_response = get_response
        if iscoroutinefunction(get_response):
            markcoroutinefunction(self)

    def __call__(self, request: HttpRequest) -> Any:
        if iscoroutinefunction(self):
            return self._acall(request)
        return self._never_cached(self.get_response(request))

    async def _acall(self, request: HttpRequest) -> HttpResponseBase:
        return self._never_cached(await self.get_response(request))

    @staticmethod
    def _never_cached(response: HttpResponseBase) -> HttpResponseBase:
        if not response.has_header("Cache-Control"):
            add_never_cache_headers(response)
        return response


def client_ip(request: HttpRequest) -> str | None:
    """The address a request comes from, for counting failed sign-ins.

    With TRUSTED_PROXY_COUNT = 0, REMOTE_ADDR. Behind N proxies that each append the address
    they received from to X-Forwarded-For, the client is the N-th entry from the right:
    entries further left were written by the client itself and could be anything.
    """
    proxies = settings.TRUSTED_PROXY_COUNT
    remote_addr: str | None = request.META.get("REMOTE_ADDR")
    if proxies <= 0:
        return remote_addr
    forwarded = [
        part.strip()
        for part in request.META.get("HTTP_X_FORWARDED_FOR", "").split(",")
        if part.strip()
    ]
    if not forwarded:
        return remote_addr
    return forwarded[-min(proxies, len(forwarded))]


# --- password reset, rate-limited ----------------------------------------------------------

RESETS_BY_ADDRESS = limits.WindowLimit("password_reset_ip")
RESETS_BY_EMAIL = limits.WindowLimit("password_reset_email")
RESET_PERIOD = 3600


class PasswordResetView(auth_views.PasswordResetView):
    """Django's password reset, with at most PASSWORD_RESETS_PER_HOUR_IP asked from one
    client address and PASSWORD_RESETS_PER_HOUR_EMAIL for one email address an hour: past
    either, 429 with Retry-After and no mail sent. Both are counted whether or not the email
    belongs to a user, so the answer tells nobody which addresses have accounts."""

    def form_valid(self, form: PasswordResetForm) -> HttpResponse:
        email = form.cleaned_data["email"].strip().lower()
        waits = [
            RESETS_BY_ADDRESS.hit(
                limits.cache_safe(client_ip(self.request) or "unknown"),
                count=settings.PASSWORD_RESETS_PER_HOUR_IP,
                period=RESET_PERIOD,
            ),
            RESETS_BY_EMAIL.hit(
                hashlib.sha256(email.encode()).hexdigest(),
                count=settings.PASSWORD_RESETS_PER_HOUR_EMAIL,
                period=RESET_PERIOD,
            ),
        ]
        wait = max((w for w in waits if w is not None), default=None)
        if wait is None:
            return super().form_valid(form)
        minutes = max(1, math.ceil(wait / 60))
        form.add_error(
            "email",
            "Too many password resets were asked for from here or for this address: no email "
            f"was sent. Try again in {minutes} minute{'s' if minutes != 1 else ''}.",
        )
        response = self.form_invalid(form)
        response.status_code = 429
        response["Retry-After"] = str(math.ceil(wait))
        return response
