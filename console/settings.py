"""Every setting comes from the environment and has a default that works with no servers."""

from __future__ import annotations

import os
from pathlib import Path

import dj_database_url

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
    return int(value) if value not in (None, "") else default


def env_list(name: str, default: str) -> list[str]:
    return [item.strip() for item in os.environ.get(name, default).split(",") if item.strip()]


DEBUG = env_bool("DEBUG", False)
# A development default only: any deployment sets SECRET_KEY (the README says so).
SECRET_KEY = os.environ.get("SECRET_KEY", "stepward-insecure-development-key-change-me")
ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", "localhost,127.0.0.1,[::1],testserver")
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", "")

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
    "ninja",
    "executor",
    "console",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "executor.http.ApiEdgeMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
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
    "django.contrib.auth.backends.ModelBackend",
    "guardian.backends.ObjectPermissionBackend",
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

EMAIL_BACKEND = os.environ.get("EMAIL_BACKEND", "django.core.mail.backends.filebased.EmailBackend")
EMAIL_FILE_PATH = os.environ.get("EMAIL_FILE_PATH", str(VAR_DIR / "mail"))
DEFAULT_FROM_EMAIL = os.environ.get("DEFAULT_FROM_EMAIL", "stepward@localhost")

# --- the agents' API -------------------------------------------------------------------
API_MAX_BODY_BYTES = env_int("API_MAX_BODY_BYTES", 64 * 1024)
API_MAX_BATCH_BODY_BYTES = env_int("API_MAX_BATCH_BODY_BYTES", 4 * 1024 * 1024)
# Django refuses larger bodies before the API's own limits could answer 413.
DATA_UPLOAD_MAX_MEMORY_SIZE = max(API_MAX_BODY_BYTES, API_MAX_BATCH_BODY_BYTES)
# Requests per minute per agent token; a shared CACHE_URL makes it hold across web processes.
API_RATE_LIMIT = os.environ.get("API_RATE_LIMIT", "1200/min")
API_MAX_WAIT_SECONDS = 30
# Long-polls (`?wait=`) one agent may hold at once; each holds a web thread while it waits.
API_MAX_WAITS_PER_AGENT = env_int("API_MAX_WAITS_PER_AGENT", 2)
# Requests with a missing or unknown token, per client address ("" or "off": no limit).
API_BAD_TOKEN_RATE = os.environ.get("API_BAD_TOKEN_RATE", "30/min")
# Unset, the client address is the peer's (REMOTE_ADDR). Behind a proxy you run, the header
# it sets (e.g. X-Forwarded-For): its last entry, the one that proxy wrote, is taken.
API_CLIENT_ADDRESS_HEADER = os.environ.get("API_CLIENT_ADDRESS_HEADER", "")
# With it set, GET /metrics needs `Authorization: Bearer <METRICS_TOKEN>` (API.md).
METRICS_TOKEN = os.environ.get("METRICS_TOKEN", "")

# --- the executor ---------------------------------------------------------------------
# Modules whose import registers tools: the built-ins, then a deployment's own (API.md).
STEPWARD_TOOLS = env_list("STEPWARD_TOOLS", "executor.tools.builtins")
# How often a process looks whether the HTTP tools defined as data changed (seconds).
EXECUTOR_TOOL_REFRESH_SECONDS = float(os.environ.get("EXECUTOR_TOOL_REFRESH_SECONDS", "2"))
EXECUTOR_LEASE_SECONDS = env_int("EXECUTOR_LEASE_SECONDS", 60)
# Keys the events' hash chain. Keep it stable: changing it makes verify_ledger report every
# event written before the change. Defaults to a value derived from SECRET_KEY.
EXECUTOR_LEDGER_KEY = os.environ.get("EXECUTOR_LEDGER_KEY") or f"ledger:{SECRET_KEY}"
EXECUTOR_APPROVAL_MAX_AGE = env_int("EXECUTOR_APPROVAL_MAX_AGE", 24 * 3600)
EXECUTOR_ALLOW_FAULTS = env_bool("EXECUTOR_ALLOW_FAULTS", False)
EXECUTOR_FAULTS = os.environ.get("EXECUTOR_FAULTS", "")
EXECUTOR_SWEEP_SECONDS = float(os.environ.get("EXECUTOR_SWEEP_SECONDS", "5"))
# What `http.get` may read: `host` (on the scheme's default port) or `host:port`. Empty by
# default: an agent's step reaches nothing that was not named here.
EXECUTOR_HTTP_ALLOWED_HOSTS = env_list("EXECUTOR_HTTP_ALLOWED_HOSTS", "")
# `http.get` stops reading a response after this many bytes (its result says it was cut).
EXECUTOR_HTTP_MAX_RESPONSE_BYTES = env_int("EXECUTOR_HTTP_MAX_RESPONSE_BYTES", 1024 * 1024)
TICKETDESK_URL = os.environ.get("TICKETDESK_URL", "http://127.0.0.1:8765")
TICKETDESK_TIMEOUT_SECONDS = float(os.environ.get("TICKETDESK_TIMEOUT_SECONDS", "10"))

# --- Celery ----------------------------------------------------------------------------
# Unset, the broker is kombu's filesystem transport in VAR_DIR: no server needed.
BROKER_DIR = Path(os.environ.get("STEPWARD_BROKER_DIR", VAR_DIR / "broker"))
CELERY_BROKER_URL = os.environ.get("CELERY_BROKER_URL", "filesystem://")
if CELERY_BROKER_URL in ("filesystem://", "stepwardfs://"):
    # kombu's filesystem transport, with atomic message files (see console/broker.py).
    CELERY_BROKER_URL = "stepwardfs://"
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
# line is about (executor/logcontext.py); otherwise plain text with the same fields.
LOG_FORMAT = os.environ.get("LOG_FORMAT", "plain")
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "plain": {
            "()": "executor.logcontext.PlainFormatter",
            "format": "%(asctime)s %(levelname)s %(name)s: %(message)s",
        },
        "json": {"()": "executor.logcontext.JsonFormatter"},
    },
    "handlers": {
        "console": {
            "class": "logging.StreamHandler",
            "formatter": "json" if LOG_FORMAT == "json" else "plain",
        }
    },
    "root": {"handlers": ["console"], "level": os.environ.get("LOG_LEVEL", "INFO")},
    "loggers": {"django.db.backends": {"level": "INFO"}},
}

# A woken worker claims due steps in batches of this many (one commit per batch)...
EXECUTOR_BATCH_SIZE = env_int("EXECUTOR_BATCH_SIZE", 100)
# ...runs write steps in a pool of this many threads (0: one at a time, in the task's thread)...
EXECUTOR_WRITE_POOL = env_int("EXECUTOR_WRITE_POOL", 8)
# ...and claims at most this many before it acknowledges its message and looks for others.
EXECUTOR_DRAIN_LIMIT = env_int("EXECUTOR_DRAIN_LIMIT", 5000)
# How often the sweeper signs a checkpoint of the ledger's chains (DESIGN.md §15).
EXECUTOR_CHECKPOINT_SECONDS = float(os.environ.get("EXECUTOR_CHECKPOINT_SECONDS", "60"))
# A due step untouched this long is assumed to have lost its message and is resent.
EXECUTOR_REDISPATCH_AFTER = float(os.environ.get("EXECUTOR_REDISPATCH_AFTER", "10"))
CELERY_BEAT_SCHEDULE = {
    "stepward-sweep": {"task": "stepward.sweep", "schedule": EXECUTOR_SWEEP_SECONDS},
}
CELERY_BEAT_SCHEDULE_FILENAME = str(VAR_DIR / "celerybeat-schedule")
