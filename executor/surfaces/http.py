"""HTTP plumbing for the agents' API: the request body limit and the one error shape."""

from __future__ import annotations

import io
import logging
import time
from typing import Any

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.conf import settings
from django.core.handlers.wsgi import WSGIRequest
from django.http import (
    HttpRequest,
    HttpResponse,
    HttpResponseBadRequest,
    HttpResponseBase,
    JsonResponse,
)

from executor.common import logcontext

logger = logging.getLogger(__name__)

API_PREFIX = "/api/"
# What a console form's chunked body may hold when DATA_UPLOAD_MAX_MEMORY_SIZE is None.
FORM_LIMIT = 2_621_440
# Batch posts carry up to 500 steps: they have a limit of their own.
BATCH_SUFFIX = "/steps/batch"

# The `code` of an error answer, by HTTP status, where nothing more specific is known.
ERROR_CODES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    411: "length_required",
    413: "body_too_large",
    415: "unsupported_media_type",
    422: "invalid_body",
    429: "rate_limited",
    500: "internal_error",
    503: "unavailable",
}
# Headers that carry meaning for a client and survive reshaping.
KEPT_HEADERS = ("Allow", "Retry-After", "WWW-Authenticate")


def error_response(status: int, code: str, message: str, details: object = None) -> JsonResponse:
    return JsonResponse(
        {"error": {"code": code, "message": message, "details": details}}, status=status
    )


class ApiEdgeMiddleware:
    """The edges of the API that the API's own handlers never see.

    Answers 413 for an API request body over API_MAX_BODY_BYTES (API_MAX_BATCH_BODY_BYTES
    for batches), before anything reads it, or, for a chunked body, once it is read that
    far: Django's own limit raises a 400 (RequestDataTooBig) deep inside body parsing, and
    agents need the 413 that API.md promises. Also puts the error answers Django and ninja make
    themselves (an unknown URL's 404, ninja's plain-text 405, a crash's 500) in the API's
    error shape, so an agent parses every error the same way.

    Sync and async (under ASGI a long-poll's await passes through it without a thread): the
    checks before the view read only the body the server has already taken in.
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
        refused = self._refused(request)
        if refused is not None:
            return refused
        if not request.path.startswith(API_PREFIX):
            return self.get_response(request)
        started = time.monotonic()
        with logcontext.bound():
            return self._logged(request, in_error_shape(self.get_response(request)), started)

    async def _acall(self, request: HttpRequest) -> HttpResponseBase:
        refused = self._refused(request)
        if refused is not None:
            return refused
        if not request.path.startswith(API_PREFIX):
            return await self.get_response(request)
        started = time.monotonic()
        with logcontext.bound():
            response = in_error_shape(await self.get_response(request))
            return self._logged(request, response, started)

    @staticmethod
    def _refused(request: HttpRequest) -> HttpResponseBase | None:
        """The answer to a request whose body cannot be acted on, before any view sees it."""
        if not request.path.startswith(API_PREFIX):
            # A chunked form post is read as the API's are (Django would see it empty).
            unsized = (
                read_unsized_body(request, settings.DATA_UPLOAD_MAX_MEMORY_SIZE or FORM_LIMIT)
                if request.method in ("POST", "PUT", "PATCH")
                and not request.META.get("CONTENT_LENGTH")
                else None
            )
            if unsized is not None:
                return unsized
            refused = refuse_unreadable_body(request)
            if refused is not None:
                return HttpResponseBadRequest(refused, content_type="text/plain; charset=utf-8")
            return None
        refused_api = refuse_large_body(request) or _bad_body(refuse_unreadable_body(request))
        if refused_api is not None:
            ApiEdgeMiddleware._logged(request, refused_api, time.monotonic())
        return refused_api

    @staticmethod
    def _logged(
        request: HttpRequest, response: HttpResponseBase, started: float
    ) -> HttpResponseBase:
        # A request's log lines carry the agent, run and step it is about (logcontext).
        logger.info(
            "%s %s %s in %.1f ms",
            request.method,
            request.path,
            response.status_code,
            (time.monotonic() - started) * 1000,
        )
        return response


def refuse_large_body(request: HttpRequest) -> HttpResponse | None:
    if request.method not in ("POST", "PUT", "PATCH"):
        return None
    limit = (
        settings.API_MAX_BATCH_BODY_BYTES
        if request.path.endswith(BATCH_SUFFIX)
        else settings.API_MAX_BODY_BYTES
    )
    declared = request.META.get("CONTENT_LENGTH") or ""
    if not declared:
        return read_unsized_body(request, limit)
    try:
        length = int(declared)
    except ValueError:
        length = -1
    if length < 0:
        return error_response(400, "bad_request", "Content-Length is not a number of bytes")
    if length > limit:
        return too_large(limit)
    return None


def read_unsized_body(request: HttpRequest, limit: int) -> HttpResponse | None:
    """Reads a body sent without Content-Length (chunked) up to `limit`: 413 past it.

    Django reads a WSGI body only as far as CONTENT_LENGTH says, so a chunked one would
    look empty. A server that de-chunks says so with `wsgi.input_terminated` (gunicorn
    does): its input is read here to its end, one byte past the limit at most. One that
    does not (runserver) answers 411 rather than act on an empty body. Under ASGI the
    handler has already read the whole body into the request's stream.
    """
    if isinstance(request, WSGIRequest):
        if "chunked" not in request.headers.get("Transfer-Encoding", "").lower():
            return None  # HTTP/1.1: neither a length nor chunks is no body.
        if not request.META.get("wsgi.input_terminated"):
            return error_response(
                411,
                "length_required",
                "this server cannot read a chunked body: send Content-Length",
            )
        try:
            body = request.META["wsgi.input"].read(limit + 1)
        except OSError as error:  # the server's de-chunking failed: bad framing, or cut off
            return error_response(400, "bad_request", unreadable(error))
    else:
        body = request.read(limit + 1)
    if len(body) > limit:
        return too_large(limit)
    request._body = body
    request._stream = io.BytesIO(body)
    return None


def refuse_unreadable_body(request: HttpRequest) -> str | None:
    """Why the body of a request that has one cannot be acted on, or None (and the body read).

    A body the server could not read (a malformed chunk, a connection closed mid-body) made
    Django's handler answer 500 wherever it was first read; a body shorter than its
    Content-Length (the sender stopped early and closed its half) was read as it was and
    could be acted on, a JSON document cut at a point where it still parses. Either is
    refused here, before any view sees it."""
    if request.method not in ("POST", "PUT", "PATCH", "DELETE"):
        return None
    if request.content_type == "multipart/form-data":
        return None  # streamed to its handlers by Django's parser, files and all
    try:
        body = request.body
    except OSError as error:  # UnreadablePostError, and the server's own reading errors
        return unreadable(error)
    declared = request.META.get("CONTENT_LENGTH") or ""
    if declared.isdigit() and len(body) < int(declared):
        return (
            f"the request body was cut off: {len(body)} of the {int(declared)} bytes its "
            "Content-Length announced arrived"
        )
    return None


def unreadable(error: BaseException) -> str:
    detail = str(error).strip() or type(error).__name__
    return f"the request body could not be read ({detail}): send it again, whole"


def _bad_body(problem: str | None) -> JsonResponse | None:
    return None if problem is None else error_response(400, "bad_request", problem)


def in_error_shape(response: HttpResponseBase) -> HttpResponseBase:
    status = response.status_code
    if status < 400 or response.get("Content-Type", "").startswith("application/json"):
        return response
    if status >= 500 and settings.DEBUG:
        # A developer wants Django's debug page with the traceback.
        return response
    shaped = error_response(status, ERROR_CODES.get(status, "error"), response.reason_phrase)
    for header in KEPT_HEADERS:
        if header in response:
            shaped[header] = response[header]
    return shaped


def too_large(limit: int) -> JsonResponse:
    return error_response(
        413,
        "body_too_large",
        f"the request body is over the limit of {limit} bytes",
        {"limit": limit},
    )
