"""Company sign-in through the company's OpenID Connect provider (docs/sign-in.md).

mozilla-django-oidc runs the code flow (state, nonce, PKCE, the ID token's signature); what is
here finds the provider's endpoints, refuses answers of the wrong shape, turns the answer into
a user whose roles follow the group claim, and shows every failure as a page of our own words:
never a 500, never the provider's text.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import jwt
import requests
from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.backends import ModelBackend
from django.contrib.auth.views import LoginView
from django.core.exceptions import SuspiciousOperation
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import render
from django.urls import reverse
from mozilla_django_oidc.auth import OIDCAuthenticationBackend
from mozilla_django_oidc.views import (
    OIDCAuthenticationCallbackView,
    OIDCAuthenticationRequestView,
)

from executor.services.signin import Person, SignInRefused, sign_in_user

logger = logging.getLogger(__name__)

# A discovery document is fetched again after this long (keys and endpoints can move).
DISCOVERY_SECONDS = 3600

UNREACHABLE = "{company} could not be reached to sign you in. Try again in a moment."
UNVERIFIED = "{company}'s answer could not be verified, so you are not signed in."
NOT_SIGNED_IN = "{company} did not sign you in: the sign-in was cancelled or refused there."
STALE = "This sign-in was not started here, or was used already. Start again."
INACTIVE = "Your Stepward account is deactivated. Ask an administrator."


class SignInFailed(Exception):
    """A sign-in that ends on the failure page; `message` is ours and safe to show."""

    def __init__(self, message: str, *, status: int = 403) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


def enabled() -> bool:
    return bool(settings.OIDC_RP_CLIENT_ID)


def company() -> str:
    return settings.OIDC_PROVIDER_NAME


@dataclass(frozen=True)
class Endpoints:
    issuer: str
    authorization: str
    token: str
    userinfo: str
    jwks: str


_discovered: dict[str, tuple[float, dict[str, Any]]] = {}

DISCOVERY_KEYS = {
    "authorization": "authorization_endpoint",
    "token": "token_endpoint",
    "userinfo": "userinfo_endpoint",
    "jwks": "jwks_uri",
}


def endpoints() -> Endpoints:
    """The provider's endpoints: those set in the settings, the others from discovery."""
    issuer = settings.OIDC_ISSUER
    chosen = {
        "authorization": settings.OIDC_OP_AUTHORIZATION_ENDPOINT,
        "token": settings.OIDC_OP_TOKEN_ENDPOINT,
        "userinfo": settings.OIDC_OP_USER_ENDPOINT,
        "jwks": settings.OIDC_OP_JWKS_ENDPOINT,
    }
    if not all(chosen.values()):
        document = _discovery(issuer)
        for name, key in DISCOVERY_KEYS.items():
            chosen[name] = chosen[name] or document[key]
    return Endpoints(issuer=issuer, **chosen)


def _discovery(issuer: str) -> dict[str, Any]:
    cached = _discovered.get(issuer)
    if cached is not None and time.monotonic() - cached[0] < DISCOVERY_SECONDS:
        return cached[1]
    url = f"{issuer}/.well-known/openid-configuration"
    try:
        response = httpx.get(url, timeout=settings.OIDC_TIMEOUT)
        response.raise_for_status()
        document = response.json()
    except (httpx.HTTPError, ValueError) as error:
        logger.warning("company sign-in: discovery at %s failed: %s", url, error)
        raise SignInFailed(UNREACHABLE.format(company=company()), status=502) from error
    problem = _discovery_problem(document, issuer)
    if problem:
        logger.warning("company sign-in: discovery at %s refused: %s", url, problem)
        raise SignInFailed(UNVERIFIED.format(company=company()), status=502)
    _discovered[issuer] = (time.monotonic(), document)
    return document


def _discovery_problem(document: Any, issuer: str) -> str:
    if not isinstance(document, dict):
        return "not a JSON object"
    if document.get("issuer") != issuer:
        return f"its issuer {document.get('issuer')!r} is not OIDC_ISSUER {issuer!r}"
    for key in DISCOVERY_KEYS.values():
        value = document.get(key)
        if not isinstance(value, str) or not value.startswith(("https://", "http://")):
            return f"{key} is not a URL"
    return ""


def discovery_forget() -> None:
    """Drops the cached discovery documents (a provider moved, or a test starts another)."""
    _discovered.clear()


@contextmanager
def provider_answer(endpoint: str) -> Iterator[None]:
    """Turns what can go wrong with an answer of the provider's into the failure page."""
    try:
        yield
    except ValueError as error:
        # Not JSON. (requests' JSONDecodeError is a RequestException too: this comes first.)
        logger.warning("company sign-in: the %s answer is not JSON: %s", endpoint, error)
        raise SignInFailed(UNVERIFIED.format(company=company()), status=502) from error
    except requests.RequestException as error:
        logger.warning("company sign-in: the %s endpoint failed: %s", endpoint, error)
        raise SignInFailed(UNREACHABLE.format(company=company()), status=502) from error


class CompanySignInBackend(OIDCAuthenticationBackend):
    """Signs in whom the provider vouches for, found by (issuer, subject), with the roles
    its group claim maps to. Inert while company sign-in is off; never answers a password."""

    OIDC_RP_IDP_SIGN_KEY = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Not the library's: it reads every endpoint when Django loads the backend, which it
        # does for each request's session; the endpoints are looked up when a sign-in runs.
        self.UserModel = get_user_model()

    @property
    def OIDC_OP_TOKEN_ENDPOINT(self) -> str:
        return endpoints().token

    @property
    def OIDC_OP_USER_ENDPOINT(self) -> str:
        return endpoints().userinfo

    @property
    def OIDC_OP_JWKS_ENDPOINT(self) -> str:
        return endpoints().jwks

    @property
    def OIDC_RP_CLIENT_ID(self) -> str:
        return settings.OIDC_RP_CLIENT_ID

    @property
    def OIDC_RP_CLIENT_SECRET(self) -> str:
        return settings.OIDC_RP_CLIENT_SECRET

    @property
    def OIDC_RP_SIGN_ALGO(self) -> str:
        return settings.OIDC_RP_SIGN_ALGO

    def authenticate(self, request: HttpRequest | None, **kwargs: Any) -> Any:
        # Only the callback passes a nonce; a password sign-in is not ours to answer.
        if not enabled() or request is None or "nonce" not in kwargs:
            return None
        return super().authenticate(request, **kwargs)

    def get_user(self, user_id: Any) -> Any:
        # ModelBackend's: a deactivated user's session signs nobody in.
        return ModelBackend.get_user(self, user_id)

    def get_token(self, payload: dict[str, Any]) -> dict[str, Any]:
        with provider_answer("token"):
            answer = super().get_token(payload)
        if not isinstance(answer, dict) or not isinstance(answer.get("id_token"), str):
            logger.warning("company sign-in: the token endpoint's answer has no ID token")
            raise SignInFailed(UNVERIFIED.format(company=company()), status=502)
        return answer

    def retrieve_matching_jwk(self, token: str) -> Any:
        with provider_answer("JWKS"):
            response = requests.get(
                self.OIDC_OP_JWKS_ENDPOINT, timeout=settings.OIDC_TIMEOUT, allow_redirects=False
            )
            response.raise_for_status()
            jwks = response.json()
        header = jwt.get_unverified_header(token)
        keys = jwks.get("keys") if isinstance(jwks, dict) else None
        if not isinstance(keys, list):
            logger.warning("company sign-in: the JWKS answer has no list of keys")
            raise SignInFailed(UNVERIFIED.format(company=company()), status=502)
        for key in keys:
            if not isinstance(key, dict) or key.get("kid") != header.get("kid"):
                continue
            if "alg" in key and key["alg"] != header.get("alg"):
                continue
            return jwt.PyJWK(key)
        logger.warning("company sign-in: no key of the JWKS signed the ID token")
        raise SignInFailed(UNVERIFIED.format(company=company()), status=502)

    def verify_token(self, token: str, **kwargs: Any) -> Any:
        try:
            return super().verify_token(token, **kwargs)
        except (SuspiciousOperation, jwt.PyJWTError) as error:
            logger.warning("company sign-in: the ID token was refused: %s", error)
            raise SignInFailed(UNVERIFIED.format(company=company())) from error

    def get_userinfo(self, access_token: str, id_token: str, payload: Any) -> dict[str, Any]:
        with provider_answer("userinfo"):
            answer = super().get_userinfo(access_token, id_token, payload)
        if not isinstance(answer, dict):
            logger.warning("company sign-in: the userinfo answer is not a JSON object")
            raise SignInFailed(UNVERIFIED.format(company=company()), status=502)
        return answer

    def get_or_create_user(self, access_token: str, id_token: str, payload: Any) -> Any:
        issuer = endpoints().issuer
        problem = id_token_problem(payload, issuer=issuer, client_id=settings.OIDC_RP_CLIENT_ID)
        if problem:
            logger.warning("company sign-in: the ID token was refused: %s", problem)
            raise SignInFailed(UNVERIFIED.format(company=company()))
        userinfo = self.get_userinfo(access_token, id_token, payload)
        if userinfo.get("sub") != payload["sub"]:
            logger.warning("company sign-in: userinfo is about another subject than the token")
            raise SignInFailed(UNVERIFIED.format(company=company()))
        claims = {**payload, **userinfo}
        groups = claimed_groups(claims, settings.OIDC_GROUPS_CLAIM)
        person = Person(
            issuer=issuer,
            subject=payload["sub"],
            username=_text(claims.get("preferred_username")) or _text(claims.get("email")),
            email=_text(claims.get("email")),
            first_name=_text(claims.get("given_name")),
            last_name=_text(claims.get("family_name")),
        )
        try:
            return sign_in_user(person=person, idp_groups=groups)
        except SignInRefused as refused:
            raise SignInFailed(refused.message) from refused


def id_token_problem(payload: Any, *, issuer: str, client_id: str) -> str:
    """What the library leaves unchecked in a verified ID token: who issued it, for whom,
    and about whom. "" when all is right."""
    if not isinstance(payload, dict):
        return "not a JSON object"
    if payload.get("iss") != issuer:
        return f"issuer {payload.get('iss')!r} is not {issuer!r}"
    audience = payload.get("aud")
    audiences = audience if isinstance(audience, list) else [audience]
    if client_id not in audiences:
        return f"audience {audience!r} is not this client"
    subject = payload.get("sub")
    if not isinstance(subject, str) or not 0 < len(subject) <= 255:
        return "no usable subject"
    return ""


def claimed_groups(claims: Mapping[str, Any], claim: str) -> list[str]:
    """The names in the group claim: absent is none; a single name is one."""
    value = claims.get(claim)
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return value
    logger.warning("company sign-in: the %s claim is not a list of names", claim)
    raise SignInFailed(UNVERIFIED.format(company=company()))


def _text(value: Any) -> str:
    return value.strip() if isinstance(value, str) else ""


def failure_page(request: HttpRequest, failure: SignInFailed) -> HttpResponse:
    return render(
        request,
        "registration/sign_in_failed.html",
        {"message": failure.message, "company": company()},
        status=failure.status,
    )


class SignInStart(OIDCAuthenticationRequestView):
    """Sends the browser to the provider (with state, nonce and a PKCE challenge)."""

    def __init__(self, **kwargs: Any) -> None:
        # The library's reads the endpoint here; it is looked up in get(), where a provider
        # that cannot be reached ends on the failure page.
        super(OIDCAuthenticationRequestView, self).__init__(**kwargs)

    def get(self, request: HttpRequest) -> HttpResponse:
        if not enabled():
            raise Http404("company sign-in is off")
        try:
            self.OIDC_OP_AUTH_ENDPOINT = endpoints().authorization
        except SignInFailed as failure:
            return failure_page(request, failure)
        self.OIDC_RP_CLIENT_ID = settings.OIDC_RP_CLIENT_ID
        return super().get(request)


class SignInCallback(OIDCAuthenticationCallbackView):
    """Where the provider sends the browser back; ends signed in or on the failure page."""

    def get(self, request: HttpRequest) -> HttpResponse:
        if not enabled():
            raise Http404("company sign-in is off")
        if request.GET.get("error"):
            # The provider's error and its description are never shown: without a state this
            # browser started, anyone could have written them.
            state = request.GET.get("state")
            if state is None or state not in request.session.get("oidc_states", {}):
                # Nor does a link anyone can send sign the person out.
                return failure_page(request, SignInFailed(STALE))
            super().get(request)  # forgets the state and signs out, as the library does
            return failure_page(request, SignInFailed(NOT_SIGNED_IN.format(company=company())))
        if "oidc_states" not in request.session or "code" not in request.GET:
            return failure_page(request, SignInFailed(STALE, status=400))
        try:
            return super().get(request)
        except SignInFailed as failure:
            return failure_page(request, failure)
        except SuspiciousOperation as error:
            # A state this browser did not start (or already used).
            logger.warning("company sign-in: %s", error)
            return failure_page(request, SignInFailed(STALE, status=400))

    def login_failure(self) -> HttpResponse:
        user = getattr(self, "user", None)
        message = INACTIVE if user is not None and not user.is_active else STALE
        return failure_page(self.request, SignInFailed(message))

    def login_success(self) -> HttpResponse:
        response = super().login_success()
        self.request.session.set_expiry(settings.OIDC_SESSION_SECONDS)
        return response


class SignInPage(LoginView):
    """Django's sign-in page, offering the company's sign-in when it is on."""

    def get_form(self, form_class: Any = None) -> Any:
        form = super().get_form(form_class)
        if enabled():
            # The company's button comes first; the cursor is not put in the password form.
            form.fields["username"].widget.attrs.pop("autofocus", None)
        return form

    def get_context_data(self, **kwargs: Any) -> dict[str, Any]:
        context = super().get_context_data(**kwargs)
        if enabled():
            context["company"] = company()
            context["company_url"] = reverse("oidc_authentication_init")
        return context
