"""Every setting comes from the environment and has a default that works with no servers."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import dj_database_url
from django.core.exceptions import ImproperlyConfigured
from django.utils.csp import CSP

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(os.environ.get("STEPWARD_VAR_DIR", BASE_DIR / "var"))
VAR_DIR.mkdir(parents=True, exist_ok=True)


def env_bool(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    return value.strip().lower() in {"1", "true", "yes", "on"}


def env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ImproperlyConfigured(f"{name} must be a whole number, not {value!r}") from None


def env_list(name: str, default: str) -> list[str]:
    return [item.strip() for item in os.environ.get(name, default).split(",") if item.strip()]


DEBUG = env_bool("DEBUG", False)

# Public, in the repository: usable only with DEBUG on. It would sign sessions and the
# ledger's chains with a key anyone can read (DESIGN.md §15), so without DEBUG the settings
# refuse to load rather than fall back to it.
DEVELOPMENT_SECRET_KEY = "stepward-insecure-development-key-change-me"  # noqa: S105


# Where `make run` keeps the machine's key (made once, random, mode 0600).
MACHINE_KEY_FILE = VAR_DIR / "secret.key"


def secret_key() -> str:
    """SECRET_KEY, or the contents of the file SECRET_KEY_FILE names (a mounted secret), or,
    with neither set, the machine's `var/secret.key` when `make run` has made one: so every
    operator command and `manage.py mcp` started by a desktop assistant (which passes on
    only the variables its configuration names) finds the key the running product uses."""
    key = os.environ.get("SECRET_KEY", "").strip()
    key_file = os.environ.get("SECRET_KEY_FILE", "").strip()
    if not key and not key_file and MACHINE_KEY_FILE.is_file():
        key_file = str(MACHINE_KEY_FILE)
    if not key and key_file:
        try:
            key = Path(key_file).read_text().strip()
        except OSError as error:
            raise ImproperlyConfigured(
                f"SECRET_KEY_FILE={key_file} cannot be read: {error}"
            ) from error
        if not key:
            raise ImproperlyConfigured(f"SECRET_KEY_FILE={key_file} is empty")
    if key and key != DEVELOPMENT_SECRET_KEY:
        return key
    if DEBUG:
        return DEVELOPMENT_SECRET_KEY
    raise ImproperlyConfigured(
        "SECRET_KEY is not set (or is the public development key) and DEBUG is off, and "
        f"there is no {MACHINE_KEY_FILE}. Run `make run` once (it makes that file, which every "
        "command then reads by itself), or set SECRET_KEY, or SECRET_KEY_FILE to a file "
        "holding it, to a long random value (python -c 'import secrets; "
        "print(secrets.token_urlsafe(50))'). DEBUG=1 allows the development key on a "
        "development machine."
    )


SECRET_KEY = secret_key()
ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", "localhost,127.0.0.1,[::1],testserver")
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", "")

# --- HTTPS ------------------------------------------------------------------------------
# One switch for a deployment served over HTTPS (behind a proxy that terminates TLS); each
# setting it turns on can still be set on its own.
HTTPS_ONLY = env_bool("HTTPS_ONLY", False)
SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", HTTPS_ONLY)
SECURE_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 365 * 24 * 3600 if HTTPS_ONLY else 0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("SECURE_HSTS_INCLUDE_SUBDOMAINS", HTTPS_ONLY)
# Preloading commits the whole domain to HTTPS in browsers for months: a deployment opts in.
SECURE_HSTS_PRELOAD = env_bool("SECURE_HSTS_PRELOAD", False)
SESSION_COOKIE_SECURE = env_bool("SESSION_COOKIE_SECURE", HTTPS_ONLY)
CSRF_COOKIE_SECURE = env_bool("CSRF_COOKIE_SECURE", HTTPS_ONLY)
# Trust the proxy's X-Forwarded-Proto. Only behind a proxy that sets it on every request:
# a client that reaches Django directly could otherwise claim HTTPS.
SECURE_PROXY_SSL_HEADER = (
    ("HTTP_X_FORWARDED_PROTO", "https") if env_bool("SECURE_PROXY_SSL_HEADER", HTTPS_ONLY) else None
)
# check --deploy advises preloading (W021) whenever HSTS is on; not preloading is a choice.
SILENCED_SYSTEM_CHECKS = [] if SECURE_HSTS_PRELOAD else ["security.W021"]

# --- what every page may load ----------------------------------------------------------
# No inline script, no eval, no inline style: the console's scripts and styles are files in
# static/ (htmx runs with allowEval off, its bars are SVG geometry). `data:` images are the
# blank favicon and the icons in the API docs' stylesheet; an image cannot run script.
SECURE_CSP = {
    "default-src": [CSP.SELF],
    "script-src": [CSP.SELF],
    "style-src": [CSP.SELF],
    "img-src": [CSP.SELF, "data:"],
    "object-src": [CSP.NONE],
    "base-uri": [CSP.NONE],
    "form-action": [CSP.SELF],
    "frame-ancestors": [CSP.NONE],
}

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "whitenoise.runserver_nostatic",
    "django.contrib.staticfiles",
    "django_htmx",
    "guardian",
    "axes",
    "ninja",
    "executor",
    "console",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.middleware.csp.ContentSecurityPolicyMiddleware",
    # Whitenoise's, sync and async (console/serving.py).
    "console.serving.StaticFiles",
    # Below whitenoise: static files keep their long cache lifetimes.
    "console.security.NoStoreMiddleware",
    "executor.surfaces.http.ApiEdgeMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
    # Last, as django-axes asks: it turns a locked-out sign-in into the lockout page.
    "axes.middleware.AxesMiddleware",
]

ROOT_URLCONF = "console.urls"
WSGI_APPLICATION = "console.wsgi.application"
ASGI_APPLICATION = "console.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

# The ledger. SQLite needs IMMEDIATE transactions: with DEFERRED, concurrent compare-and-set
# writers fail with "database is locked" whatever the timeout (see STACK-NOTES).
SQLITE_OPTIONS = {
    "transaction_mode": "IMMEDIATE",
    "timeout": 20,
    "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
}
DATABASE_URL = os.environ.get("DATABASE_URL", "")
if DATABASE_URL:
    _db = dj_database_url.parse(DATABASE_URL, conn_max_age=600, conn_health_checks=True)
    if _db["ENGINE"] == "django.db.backends.sqlite3":
        _db["CONN_MAX_AGE"] = 0
        _db["OPTIONS"] = {**SQLITE_OPTIONS, **_db.get("OPTIONS", {})}
    elif env_bool("DATABASE_PREPARED_STATEMENTS", True):
        # Parameters bound by the server, and a statement run five times on a connection is
        # prepared there: the hot statements (a post's permission query, a claim, a persist)
        # skip parsing and planning, most of their time. Off (0) behind a pooler that cannot
        # keep prepared statements (PgBouncer in transaction mode before 1.21).
        _db["OPTIONS"] = {
            "server_side_binding": True,
            "prepare_threshold": 5,
            **_db.get("OPTIONS", {}),
        }
else:
    _db = {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": str(VAR_DIR / "stepward.sqlite3"),
        "OPTIONS": SQLITE_OPTIONS,
    }
if _db["ENGINE"] == "django.db.backends.sqlite3":
    # A file, not memory, so that worker processes started by the tests share it; one per
    # test process, so parallel test runs never share one.
    _db["TEST"] = {"NAME": str(VAR_DIR / f"test-{os.getpid()}.sqlite3")}
DATABASES = {"default": _db}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTHENTICATION_BACKENDS = [
    # First: it refuses a locked-out username and address before a password is checked.
    "axes.backends.AxesStandaloneBackend",
    "django.contrib.auth.backends.ModelBackend",
    "guardian.backends.ObjectPermissionBackend",
    # Inert until OIDC_RP_CLIENT_ID is set (console/signin.py).
    "console.signin.CompanySignInBackend",
]
# guardian's anonymous user is not used: every console page requires a login.
ANONYMOUS_USER_NAME = None
GUARDIAN_RAISE_403 = False

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

STATIC_URL = "/static/"
STATIC_ROOT = BASE_DIR / "staticfiles"
STATICFILES_DIRS = [BASE_DIR / "static"]
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "console.storage.StaticStorage"},
}
if DEBUG:
    STORAGES["staticfiles"] = {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"}
WHITENOISE_USE_FINDERS = True
WHITENOISE_AUTOREFRESH = DEBUG

LOGIN_URL = "/accounts/login/"
LOGIN_REDIRECT_URL = "/"
LOGOUT_REDIRECT_URL = "login"

# --- company sign-in (OpenID Connect, docs/sign-in.md) ------------------------------------
# On when OIDC_RP_CLIENT_ID is set: the sign-in page offers "Sign in with OIDC_PROVIDER_NAME".
# Endpoints come from the issuer's discovery document unless set one by one.
OIDC_ISSUER = os.environ.get("OIDC_ISSUER", "").strip().rstrip("/")
OIDC_RP_CLIENT_ID = os.environ.get("OIDC_RP_CLIENT_ID", "").strip()
OIDC_RP_CLIENT_SECRET = os.environ.get("OIDC_RP_CLIENT_SECRET", "")
if not OIDC_RP_CLIENT_SECRET and os.environ.get("OIDC_RP_CLIENT_SECRET_FILE"):
    try:
        OIDC_RP_CLIENT_SECRET = Path(os.environ["OIDC_RP_CLIENT_SECRET_FILE"]).read_text().strip()
    except OSError as error:
        raise ImproperlyConfigured(
            f"OIDC_RP_CLIENT_SECRET_FILE={os.environ['OIDC_RP_CLIENT_SECRET_FILE']} cannot be "
            f"read: {error}"
        ) from error
OIDC_PROVIDER_NAME = os.environ.get("OIDC_PROVIDER_NAME", "your company account")
OIDC_OP_AUTHORIZATION_ENDPOINT = os.environ.get("OIDC_OP_AUTHORIZATION_ENDPOINT", "")
OIDC_OP_TOKEN_ENDPOINT = os.environ.get("OIDC_OP_TOKEN_ENDPOINT", "")
OIDC_OP_USER_ENDPOINT = os.environ.get("OIDC_OP_USER_ENDPOINT", "")
OIDC_OP_JWKS_ENDPOINT = os.environ.get("OIDC_OP_JWKS_ENDPOINT", "")
OIDC_RP_SIGN_ALGO = os.environ.get("OIDC_RP_SIGN_ALGO", "RS256")
OIDC_RP_SCOPES = os.environ.get("OIDC_RP_SCOPES", "openid email profile")
# The claim (in the ID token or the userinfo answer) that lists the person's groups.
OIDC_GROUPS_CLAIM = os.environ.get("OIDC_GROUPS_CLAIM", "groups")
OIDC_USE_PKCE = env_bool("OIDC_USE_PKCE", True)
OIDC_TIMEOUT = env_int("OIDC_TIMEOUT", 10)
# A session begun at the provider lasts this long; the next sign-in re-syncs the roles.
OIDC_SESSION_SECONDS = env_int("OIDC_SESSION_SECONDS", 8 * 3600)
if OIDC_RP_CLIENT_ID and not OIDC_ISSUER:
    raise ImproperlyConfigured(
        "OIDC_RP_CLIENT_ID is set but OIDC_ISSUER is not: set it to the provider's issuer "
        "(e.g. https://sso.example.com/realms/acme); docs/sign-in.md has examples."
    )

# --- sign-in throttling (django-axes), for the console's and the admin's sign-in -------------
AXES_ENABLED = env_bool("AXES_ENABLED", True)
# After this many failures in a row the pair (username, address) is locked out, the right
# password included; another user, or the same user from elsewhere, can still sign in.
AXES_FAILURE_LIMIT = env_int("AXES_FAILURE_LIMIT", 5)
# "username+ip_address" locks the pair; "username,ip_address" each on its own.
AXES_LOCKOUT_PARAMETERS: list[str | list[str]] = [
    group.split("+") if "+" in group else group
    for group in env_list("AXES_LOCKOUT_PARAMETERS", "username+ip_address")
]
# Minutes until a lockout lifts by itself; 0: only `manage.py axes_reset` lifts it.
AXES_COOLOFF_MINUTES = env_int("AXES_COOLOFF_MINUTES", 15)
AXES_COOLOFF_TIME = timedelta(minutes=AXES_COOLOFF_MINUTES) if AXES_COOLOFF_MINUTES else None
AXES_RESET_ON_SUCCESS = True
AXES_LOCKOUT_TEMPLATE = "registration/locked_out.html"
# The address a sign-in comes from: REMOTE_ADDR, or behind proxies that append to
# X-Forwarded-For, the address the outermost of TRUSTED_PROXY_COUNT proxies saw.
TRUSTED_PROXY_COUNT = env_int("TRUSTED_PROXY_COUNT", 0)
AXES_CLIENT_IP_CALLABLE = "console.security.client_ip"
# Password resets asked for in an hour, from one client address and for one email address;
# past either, 429 and no mail (console/security.py).
PASSWORD_RESETS_PER_HOUR_IP = env_int("PASSWORD_RESETS_PER_HOUR_IP", 5)
PASSWORD_RESETS_PER_HOUR_EMAIL = env_int("PASSWORD_RESETS_PER_HOUR_EMAIL", 3)

CACHES = {
    "default": (
        {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": os.environ["CACHE_URL"],
        }
        if os.environ.get("CACHE_URL")
        else {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}
    )
}

# Where `email.send` delivers (Django 6.1's MAILERS): by default a file per message under
# var/mail; EMAIL_BACKEND=django.core.mail.backends.smtp.EmailBackend with EMAIL_HOST,
# EMAIL_PORT, EMAIL_HOST_USER, EMAIL_HOST_PASSWORD and EMAIL_USE_TLS sends through SMTP.
_MAIL_BACKEND = os.environ.get("EMAIL_BACKEND", "django.core.mail.backends.filebased.EmailBackend")
_MAIL_OPTIONS: dict[str, Any] = {}
if _MAIL_BACKEND.endswith("filebased.EmailBackend"):
    _MAIL_OPTIONS["file_path"] = os.environ.get("EMAIL_FILE_PATH", str(VAR_DIR / "mail"))
elif _MAIL_BACKEND.endswith("smtp.EmailBackend"):
    _MAIL_OPTIONS.update(
        host=os.environ.get("EMAIL_HOST", "localhost"),
        port=env_int("EMAIL_PORT", 25),
        username=os.environ.get("EMAIL_HOST_USER", ""),
        password=os.environ.get("EMAIL_HOST_PASSWORD", ""),
        use_tls=env_bool("EMAIL_USE_TLS", False),
        timeout=env_int("EMAIL_TIMEOUT", 10),
    )
MAILERS = {"default": {"BACKEND": _MAIL_BACKEND, "OPTIONS": _MAIL_OPTIONS}}
DEFAULT_FROM_EMAIL = os.environ.get("DEFAULT_FROM_EMAIL", "stepward@localhost")

# --- the agents' API -------------------------------------------------------------------
API_MAX_BODY_BYTES = env_int("API_MAX_BODY_BYTES", 64 * 1024)
API_MAX_BATCH_BODY_BYTES = env_int("API_MAX_BATCH_BODY_BYTES", 4 * 1024 * 1024)
# Django refuses larger bodies before the API's own limits could answer 413.
DATA_UPLOAD_MAX_MEMORY_SIZE = max(API_MAX_BODY_BYTES, API_MAX_BATCH_BODY_BYTES)
# Under ASGI (console/serving.py): a request's whole body within this many seconds of its
# headers, and at most this many bytes, or 408 / 413 and the connection closed. There, too,
# PostgreSQL connections come from a pool of DATABASE_POOL_SIZE a process.
REQUEST_BODY_SECONDS = env_int("REQUEST_BODY_SECONDS", 10)
REQUEST_BODY_MAX_BYTES = env_int("REQUEST_BODY_MAX_BYTES", DATA_UPLOAD_MAX_MEMORY_SIZE)
# Requests per minute per agent token; a shared CACHE_URL makes it hold across web processes.
API_RATE_LIMIT = os.environ.get("API_RATE_LIMIT", "1200/min")
API_MAX_WAIT_SECONDS = 30
# Long-polls (`?wait=`) one agent may hold at once; each holds a web thread while it waits.
API_MAX_WAITS_PER_AGENT = env_int("API_MAX_WAITS_PER_AGENT", 2)
# ...every agent's together (in the cache: across web processes with CACHE_URL set)...
API_MAX_WAITS = env_int("API_MAX_WAITS", 1000)
# ...and one web process's. Under WSGI keep it below its request threads (gunicorn
# --threads), so that waits never hold the threads other requests need; under ASGI (the
# uvicorn worker) a wait holds no thread and no connection (executor/surfaces/waits.py).
API_MAX_WAITS_PER_PROCESS = env_int("API_MAX_WAITS_PER_PROCESS", 4)
API_MAX_WAITS_PER_EVENT_LOOP = env_int("API_MAX_WAITS_PER_EVENT_LOOP", 500)
# Requests with a missing or unknown token, per client address ("" or "off": no limit).
API_BAD_TOKEN_RATE = os.environ.get("API_BAD_TOKEN_RATE", "30/min")
# Unset, the client address is the peer's (REMOTE_ADDR). Behind a proxy you run, the header
# it sets (e.g. X-Forwarded-For): its last entry, the one that proxy wrote, is taken.
API_CLIENT_ADDRESS_HEADER = os.environ.get("API_CLIENT_ADDRESS_HEADER", "")
# How long an MCP tool call waits for its step before answering where it is (seconds).
# Below 5: the OpenAI Agents SDK's MCP client gives up on an answer after 5 s by default.
MCP_WAIT_SECONDS = float(os.environ.get("MCP_WAIT_SECONDS", "3"))
# An MCP call without a `key` is the same step as an identical call (tool and arguments)
# made within this many seconds before it: a framework's blind retry (0: never).
MCP_DEDUP_SECONDS = env_int("MCP_DEDUP_SECONDS", 600)
# With it set, GET /metrics needs `Authorization: Bearer <METRICS_TOKEN>` (API.md).
METRICS_TOKEN = os.environ.get("METRICS_TOKEN", "")

# --- the executor ---------------------------------------------------------------------
# Modules whose import registers tools: the built-ins, then a deployment's own (API.md).
STEPWARD_TOOLS = env_list("STEPWARD_TOOLS", "executor.tools.builtins")
# How often a process looks whether the HTTP tools defined as data changed (seconds).
EXECUTOR_TOOL_REFRESH_SECONDS = float(os.environ.get("EXECUTOR_TOOL_REFRESH_SECONDS", "2"))
# How long an MCP upstream gets to start (a stdio command) or be reached, and answer its
# initialization, before it counts as unavailable (API.md "MCP gateway").
EXECUTOR_UPSTREAM_START_SECONDS = float(os.environ.get("EXECUTOR_UPSTREAM_START_SECONDS", "30"))
EXECUTOR_LEASE_SECONDS = env_int("EXECUTOR_LEASE_SECONDS", 60)
# Keys the events' hash chain. Keep it stable: changing it makes verify_ledger report every
# event written before the change. Defaults to a value derived from SECRET_KEY.
EXECUTOR_LEDGER_KEY = os.environ.get("EXECUTOR_LEDGER_KEY") or f"ledger:{SECRET_KEY}"
if not DEBUG and DEVELOPMENT_SECRET_KEY in EXECUTOR_LEDGER_KEY:
    raise ImproperlyConfigured(
        "EXECUTOR_LEDGER_KEY is the public development key and DEBUG is off: unset it (it "
        "then derives from SECRET_KEY) or set it to a long random value."
    )
EXECUTOR_APPROVAL_MAX_AGE = env_int("EXECUTOR_APPROVAL_MAX_AGE", 24 * 3600)
# Four eyes: who requested a step (a compensation) may not approve it, unless this is on.
EXECUTOR_ALLOW_SELF_APPROVAL = env_bool("EXECUTOR_ALLOW_SELF_APPROVAL", False)
EXECUTOR_ALLOW_FAULTS = env_bool("EXECUTOR_ALLOW_FAULTS", False)
EXECUTOR_FAULTS = os.environ.get("EXECUTOR_FAULTS", "")
EXECUTOR_SWEEP_SECONDS = float(os.environ.get("EXECUTOR_SWEEP_SECONDS", "5"))
# What `http.get` may read: `host` (on the scheme's default port) or `host:port`. Empty by
# default (with a database server or a broker server set): an agent's step reaches nothing
# that was not named here. The embedded setup (`make run`: SQLite and the embedded broker)
# allows the ticket desk it starts, 127.0.0.1:TICKETDESK_PORT, so that the tools files of the
# docs load and run as written; setting the variable (even to nothing) decides otherwise.
EMBEDDED = not DATABASE_URL and os.environ.get("CELERY_BROKER_URL", "filesystem://").startswith(
    ("filesystem://", "stepwardfs://")
)
EXECUTOR_HTTP_ALLOWED_HOSTS = env_list(
    "EXECUTOR_HTTP_ALLOWED_HOSTS",
    f"127.0.0.1:{env_int('TICKETDESK_PORT', 8765)}" if EMBEDDED else "",
)
if EMBEDDED:
    # The demo desk takes any bearer token; the docs' desk tools send ${DESK_TOKEN}. A
    # deployment's tools read their secrets from its own environment, never a default.
    os.environ.setdefault("DESK_TOKEN", "demo-desk-accepts-any-token")
# `http.get` stops reading a response after this many bytes (its result says it was cut).
EXECUTOR_HTTP_MAX_RESPONSE_BYTES = env_int("EXECUTOR_HTTP_MAX_RESPONSE_BYTES", 1024 * 1024)
# Where `manage.py up` serves the console and API (`up --port` overrides it).
PORT = env_int("PORT", 8000)
# The console's address as agents reach it: MCP answers over stdio link steps there (over
# HTTP the request's own address is used).
STEPWARD_PUBLIC_URL = os.environ.get("STEPWARD_PUBLIC_URL", f"http://127.0.0.1:{PORT}")
# Where `manage.py up` and `manage.py ticketdesk` serve the desk; the tools reach it at
# TICKETDESK_URL, which follows this port unless set.
TICKETDESK_PORT = env_int("TICKETDESK_PORT", 8765)
TICKETDESK_URL = os.environ.get("TICKETDESK_URL", f"http://127.0.0.1:{TICKETDESK_PORT}")
TICKETDESK_TIMEOUT_SECONDS = float(os.environ.get("TICKETDESK_TIMEOUT_SECONDS", "10"))

# --- Celery ----------------------------------------------------------------------------
# Unset, the broker is kombu's filesystem transport in VAR_DIR: no server needed.
BROKER_DIR = Path(os.environ.get("STEPWARD_BROKER_DIR", VAR_DIR / "broker"))
CELERY_BROKER_URL = os.environ.get("CELERY_BROKER_URL", "filesystem://")
# Any stepwardfs:// URL is the embedded broker: a worker started with this process's own
# (stepwardfs://localhost/) must find the same one.
if CELERY_BROKER_URL == "filesystem://" or CELERY_BROKER_URL.startswith("stepwardfs://"):
    # kombu's filesystem transport, with atomic message files (see console/broker.py).
    # With a host named, kombu does not warn "No hostname was supplied" in every process.
    CELERY_BROKER_URL = "stepwardfs://localhost/"
    CELERY_BROKER_TRANSPORT_OPTIONS: dict[str, object] = {
        "data_folder_in": str(BROKER_DIR / "messages"),
        "data_folder_out": str(BROKER_DIR / "messages"),
        "processed_folder": str(BROKER_DIR / "processed"),
        "control_folder": str(BROKER_DIR / "control"),
        "store_processed": False,
        "polling_interval": 0.01,
    }
else:
    CELERY_BROKER_TRANSPORT_OPTIONS = {}
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_IGNORE_RESULT = True
CELERY_RESULT_BACKEND = None
CELERY_TASK_DEFAULT_QUEUE = os.environ.get("CELERY_QUEUE", "stepward")
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_WORKER_HIJACK_ROOT_LOGGER = False

# LOG_FORMAT=json: one JSON object a line, with the step, run, workspace and attempt each
# line is about (executor/common/logcontext.py); otherwise plain text with the same fields.
LOG_FORMAT = os.environ.get("LOG_FORMAT", "plain")
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "plain": {
            "()": "executor.common.logcontext.PlainFormatter",
            "format": "%(asctime)s %(levelname)s %(name)s: %(message)s",
        },
        "json": {"()": "executor.common.logcontext.JsonFormatter"},
    },
    "handlers": {
        "console": {
            "class": "logging.StreamHandler",
            "formatter": "json" if LOG_FORMAT == "json" else "plain",
        },
        "discard": {"class": "logging.NullHandler"},
    },
    "root": {"handlers": ["console"], "level": os.environ.get("LOG_LEVEL", "INFO")},
    "loggers": {
        "django.db.backends": {"level": "INFO"},
        # django-axes announces its version at INFO in every process that loads Django; its
        # sign-in failures and lockouts (axes.handlers) are still logged.
        "axes.apps": {"level": "WARNING"},
        # httpx and httpcore log every request's full URL at INFO and DEBUG, its query (an
        # api_key=) with it: a tool call's URL stays out of the log.
        "httpx": {"level": "WARNING"},
        "httpcore": {"level": "WARNING"},
        # Apprise logs the URL it could not parse, credentials and all: its lines go nowhere
        # but to executor/notifications/outbox.py, which reads them while it sends and keeps
        # the error, redacted, on the delivery (admin).
        "apprise": {"handlers": ["discard"], "propagate": False, "level": "ERROR"},
    },
}

# A woken worker claims due steps in batches of this many (one commit per batch)...
EXECUTOR_BATCH_SIZE = env_int("EXECUTOR_BATCH_SIZE", 100)
# ...keeps up to this many calls in flight per worker process, none holding a database
# connection (DESIGN.md §16; 0: one call at a time, in the task's thread)...
EXECUTOR_MAX_IN_FLIGHT = env_int("EXECUTOR_MAX_IN_FLIGHT", 256)
# ...on at most this many database connections per worker process: the engine uses two (the
# drain's and its lease keeper's), whatever the calls in flight; fewer cannot run it.
EXECUTOR_DB_CONNECTIONS = env_int("EXECUTOR_DB_CONNECTIONS", 4)
if EXECUTOR_DB_CONNECTIONS < 2:
    raise ImproperlyConfigured(
        "EXECUTOR_DB_CONNECTIONS must be at least 2: a worker process uses one connection to "
        "claim and commit and one to renew its leases."
    )
if "EXECUTOR_WRITE_POOL" in os.environ:
    raise ImproperlyConfigured(
        "EXECUTOR_WRITE_POOL is gone: calls no longer each hold a thread and a connection. "
        "Unset it; EXECUTOR_MAX_IN_FLIGHT (default 256) bounds the calls in flight per worker."
    )
# ...and claims at most this many before it acknowledges its message and looks for others.
EXECUTOR_DRAIN_LIMIT = env_int("EXECUTOR_DRAIN_LIMIT", 5000)
# How often the sweeper signs a checkpoint of the ledger's chains (DESIGN.md §15).
EXECUTOR_CHECKPOINT_SECONDS = float(os.environ.get("EXECUTOR_CHECKPOINT_SECONDS", "60"))
# A file each checkpoint's head is appended to, beside the log line every checkpoint writes:
# put it where the database's owner cannot rewrite it (another host, an append-only mount),
# and `verify_ledger --against` it. Empty: the log line only.
EXECUTOR_CHECKPOINT_EXPORT = os.environ.get("EXECUTOR_CHECKPOINT_EXPORT", "")
# Retention (API.md, docs/retention.md): the sweeper archives, once a day, the runs with
# nothing left to do and no change for this many days into EXECUTOR_ARCHIVE_DIR, then
# deletes them. 0 (the default) keeps everything forever.
EXECUTOR_RETENTION_DAYS = float(os.environ.get("EXECUTOR_RETENTION_DAYS", "0"))
EXECUTOR_ARCHIVE_DIR = os.environ.get("EXECUTOR_ARCHIVE_DIR", str(VAR_DIR / "archive"))
# A run with nothing left to do (no step on its way, awaiting approval or waiting for a
# person) and made more than this many seconds ago is closed by the sweeper; a step posted
# into it opens it again.
EXECUTOR_CLOSE_RUNS_AFTER = float(os.environ.get("EXECUTOR_CLOSE_RUNS_AFTER", "300"))
# A due step untouched this long is assumed to have lost its message and is resent.
EXECUTOR_REDISPATCH_AFTER = float(os.environ.get("EXECUTOR_REDISPATCH_AFTER", "10"))
CELERY_BEAT_SCHEDULE = {
    "stepward-sweep": {"task": "stepward.sweep", "schedule": EXECUTOR_SWEEP_SECONDS},
}
CELERY_BEAT_SCHEDULE_FILENAME = str(VAR_DIR / "celerybeat-schedule")

# --- notifications (docs/notifications.md) -------------------------------------------------
# Apprise URLs told about every workspace's waiting items, separated by spaces or newlines
# (not commas: an Apprise URL may hold one, as in mailto://…?to=a@x,b@y). Per workspace:
# admin's notify subscriptions.
NOTIFY_URLS = os.environ.get("NOTIFY_URLS", "").split()
# At most one message per subscriber per this many seconds: what arrives meanwhile waits for
# the next message, a digest.
NOTIFY_DIGEST_SECONDS = float(os.environ.get("NOTIFY_DIGEST_SECONDS", "60"))
# Signs the JSON webhooks' bodies (X-Stepward-Signature). Unset: json:// deliveries fail
# (visibly, in admin) rather than go out unsigned.
NOTIFY_SIGNING_KEY = os.environ.get("NOTIFY_SIGNING_KEY", "")
# Retries of a message that could not be delivered: the n-th waits
# min(NOTIFY_RETRY_SECONDS * 2**(n-1), NOTIFY_RETRY_MAX_SECONDS); after NOTIFY_MAX_ATTEMPTS
# attempts it is given up (and shown as failed in admin).
NOTIFY_MAX_ATTEMPTS = env_int("NOTIFY_MAX_ATTEMPTS", 10)
NOTIFY_RETRY_SECONDS = float(os.environ.get("NOTIFY_RETRY_SECONDS", "30"))
NOTIFY_RETRY_MAX_SECONDS = float(os.environ.get("NOTIFY_RETRY_MAX_SECONDS", "3600"))
# Sent and failed messages, and the notifications they held, are deleted after this long.
NOTIFY_KEEP_DAYS = env_int("NOTIFY_KEEP_DAYS", 30)

# --- the review desk (docs/reviewers.md) ------------------------------------------------
# A reviewer's claim on an item ("being handled by …") lapses after this many minutes.
REVIEW_CLAIM_MINUTES = env_int("REVIEW_CLAIM_MINUTES", 15)
# How often an open step page asks whether someone else decided or claimed it (seconds).
CONSOLE_LIVE_SECONDS = env_int("CONSOLE_LIVE_SECONDS", 3)
