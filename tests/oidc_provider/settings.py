"""The test provider's settings: everything from the environment `serve.py` sets."""

from __future__ import annotations

import os
from pathlib import Path

HERE = Path(__file__).resolve().parent
SECRET_KEY = "oidc-test-provider-only-not-a-secret-0123456789abcdef"
DEBUG = False
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]
ROOT_URLCONF = "tests.oidc_provider.urls"
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

INSTALLED_APPS = [
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "oauth2_provider",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
]
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [HERE / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {"context_processors": ["django.template.context_processors.request"]},
    }
]
# The provider serves on threads: two sign-ins that exchange their codes at once write at
# once. SQLite's deferred transactions fail a read lock's upgrade at once ("database is
# locked", a 500 at the token endpoint); taking the write lock when a transaction begins
# makes the second wait its turn (up to `timeout` seconds) instead.
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.environ["OIDC_PROVIDER_DB"],
        "OPTIONS": {"transaction_mode": "IMMEDIATE", "timeout": 30},
    }
}
# A browser keeps cookies per host, not per port: the console on the same host must not
# have its session cookie overwritten by the provider's.
SESSION_COOKIE_NAME = "provider_session"
CSRF_COOKIE_NAME = "provider_csrf"
LOGIN_URL = "/accounts/login/"

OAUTH2_PROVIDER = {
    "OIDC_ENABLED": True,
    "OIDC_ISS_ENDPOINT": os.environ["OIDC_PROVIDER_ISSUER"],
    "OIDC_RSA_PRIVATE_KEY": Path(os.environ["OIDC_PROVIDER_KEY"]).read_text(),
    "SCOPES": {
        "openid": "Sign in",
        "profile": "Your name",
        "email": "Your email address",
        "groups": "Your groups",
    },
    "OAUTH2_VALIDATOR_CLASS": "tests.oidc_provider.validator.GroupsValidator",
    "PKCE_REQUIRED": True,
}
# A test provider: hashing passwords slowly would only slow the tests.
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
