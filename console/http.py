"""Typed requests for the console's views: what the middleware and login guarantee."""

from __future__ import annotations

from django.contrib.auth.models import User
from django.http import HttpRequest
from django_htmx.middleware import HtmxDetails


class HtmxHttpRequest(HttpRequest):
    htmx: HtmxDetails


class ReviewerRequest(HtmxHttpRequest):
    """A request that passed the console's login check, so `user` is a real user."""

    user: User
