"""`GET /metrics`: the ledger in Prometheus text format, or OpenMetrics when the scraper's
`Accept` asks for it (API.md "For operators: metrics")."""

from __future__ import annotations

from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.utils.crypto import constant_time_compare
from django.views.decorators.http import require_GET
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from executor.surfaces.metrics import LedgerCollector


@require_GET
def metrics(request: HttpRequest) -> HttpResponse:
    """The series, computed now; with METRICS_TOKEN set, for its bearer only."""
    token = settings.METRICS_TOKEN
    if token and not constant_time_compare(
        request.headers.get("Authorization", ""), f"Bearer {token}"
    ):
        response = HttpResponse("a valid bearer token is required\n", status=401)
        response["WWW-Authenticate"] = 'Bearer realm="metrics"'
        return response
    registry = CollectorRegistry(auto_describe=False)
    registry.register(LedgerCollector())
    encode, content_type = choose_encoder(request.headers.get("Accept", ""))
    response = HttpResponse(encode(registry), content_type=content_type)
    response["Vary"] = "Accept"
    return response
