"""What the web process adds for safety beyond Django's own: pages no cache keeps, and the
client address that sign-in throttling counts failures by."""

from __future__ import annotations

from collections.abc import Callable

from django.conf import settings
from django.http import HttpRequest, HttpResponseBase
from django.utils.cache import add_never_cache_headers


class NoStoreMiddleware:
    """`Cache-Control: no-store` (with Django's other never-cache headers) on every response
    that has not said how it may be cached: console pages show ledger data and decisions,
    which neither a shared proxy nor the browser's back button should keep.

    Static files are answered by whitenoise above this middleware and keep their caching.
    """

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponseBase]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponseBase:
        response = self.get_response(request)
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
