"""What the web process adds for safety beyond Django's own: pages no cache keeps."""

from __future__ import annotations

from collections.abc import Callable

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
