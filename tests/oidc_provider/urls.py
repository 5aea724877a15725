"""The provider's endpoints (under /o/), its sign-in page, the tests' control endpoint, and
endpoints that answer the way broken providers do, for the failure tests."""

from __future__ import annotations

import json
import os

from django.contrib.auth.models import Group, User
from django.contrib.auth.views import LoginView
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.urls import include, path
from django.views.decorators.csrf import csrf_exempt


@csrf_exempt
def control_user(request: HttpRequest) -> HttpResponse:
    """Creates or changes a person at the provider: password, groups, name, email."""
    if request.headers.get("X-Control-Token") != os.environ["OIDC_PROVIDER_CONTROL_TOKEN"]:
        return HttpResponse(status=403)
    body = json.loads(request.body)
    user, _ = User.objects.get_or_create(username=body["username"])
    user.set_password(body["password"])
    user.email = body.get("email", "")
    user.first_name = body.get("first_name", "")
    user.last_name = body.get("last_name", "")
    user.save()
    user.groups.set([Group.objects.get_or_create(name=name)[0] for name in body["groups"]])
    return JsonResponse({"sub": str(user.pk)})


def userinfo_list(request: HttpRequest) -> HttpResponse:
    return JsonResponse(["not", "an", "object"], safe=False)


def jwks_without_keys(request: HttpRequest) -> HttpResponse:
    return JsonResponse({"keys": "none here"})


def jwks_html(request: HttpRequest) -> HttpResponse:
    return HttpResponse("<html>maintenance</html>", content_type="text/html")


urlpatterns = [
    path("o/", include("oauth2_provider.urls", namespace="oauth2_provider")),
    path("accounts/login/", LoginView.as_view(), name="login"),
    path("control/users/", control_user),
    path("faults/userinfo-list/", userinfo_list),
    path("faults/jwks-without-keys/", jwks_without_keys),
    path("faults/jwks-html/", jwks_html),
]
