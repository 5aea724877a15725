"""The drill's options (DrillConfig and its fault specs) and where it runs: the database
and broker that its worker processes are handed."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import connection

from executor.common import faults
from executor.drill.broken import BREAKS

DEFAULT_WORKER_FAULTS = "before_invoke:0.05,after_submit:0.05,before_persist:0.05"
# The latency keeps a worker inside its desk call long enough for a freeze to land there.
DEFAULT_DESK_FAULTS = "503:0.05,429:0.05,drop:0.03,latency:25"
DESK_FAULT_SETTINGS = {
    "503": "error_503_rate",
    "429": "error_429_rate",
    "drop": "drop_after_commit_rate",
}
MAX_DESK_LATENCY_MS = 10_000

# The built-in tools every drill posts to; `--tools-file` adds HTTP tools to them.
TOOLS = ("echo", "ticketdesk.create", "ticketdesk.create_keyed")


class DrillError(Exception):
    """The drill could not be carried out (bad options, a process that would not run)."""


# --- options ----------------------------------------------------------------------------


def parse_worker_faults(spec: str) -> dict[str, float]:
    """`before_invoke:0.05,after_submit:0.05,...` (the points of executor.common.faults)."""
    try:
        return faults.parse(spec)
    except ImproperlyConfigured as error:
        raise DrillError(f"--rates: {error}") from None


def parse_desk_faults(spec: str) -> dict[str, float]:
    """`503:0.05,429:0.05,drop:0.03,latency:25`: the desk's fault rates by short name, and
    the latency of its writes in milliseconds."""
    rates: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, sep, value = item.partition(":")
        if not sep or (name not in DESK_FAULT_SETTINGS and name != "latency"):
            raise DrillError(
                f"--desk-faults: {item!r} is not name:value with a name of "
                f"{', '.join(DESK_FAULT_SETTINGS)}, latency"
            )
        try:
            rate = float(value)
        except ValueError:
            raise DrillError(f"--desk-faults: {value!r} is not a number") from None
        if name == "latency" and not 0 <= rate <= MAX_DESK_LATENCY_MS:
            raise DrillError(f"--desk-faults: latency must be in [0, {MAX_DESK_LATENCY_MS}] ms")
        if name != "latency" and not 0 <= rate <= 1:
            raise DrillError(f"--desk-faults: rate {rate} is outside [0, 1]")
        rates[name] = rate
    return rates


# What `--upstream` may name ("" for none).
UPSTREAMS = ("", "git")


@dataclass
class DrillConfig:
    steps: int = 300
    workers: int = 2
    worker_faults: dict[str, float] = field(
        default_factory=lambda: parse_worker_faults(DEFAULT_WORKER_FAULTS)
    )
    desk_faults: dict[str, float] = field(
        default_factory=lambda: parse_desk_faults(DEFAULT_DESK_FAULTS)
    )
    # Mean seconds between two random SIGKILLs of a worker; 0 for none.
    kill_every: float = 10.0
    # Mean seconds between two freezes (SIGSTOP past the lease, then SIGCONT); 0 for none.
    # A frozen worker wakes up after its step was taken over: its writes must be refused.
    freeze_every: float = 15.0
    seed: int = field(default_factory=lambda: secrets.randbelow(2**31))
    # "" means the database this process uses.
    database_url: str = ""
    # "" means this process's broker, or a fresh embedded one when that is the default.
    broker_url: str = ""
    timeout: float = 900.0
    # Share of the desk steps that a drill reviewer compensates once they complete.
    compensate: float = 0.1
    # Steps a worker claims in one commit (EXECUTOR_BATCH_SIZE). A crash strands its whole
    # batch until the lease expires; with the drill's crash rates, production's 100 would
    # leave most of a drill waiting on leases. 10 still claims, calls and persists in batches.
    batch_size: int = 10
    # Short, so that crashed attempts are recovered within the drill (DESIGN.md §7).
    lease_seconds: int = 5
    sweep_seconds: float = 1.0
    redispatch_after: float = 3.0
    retry_after: int = 1
    # A deliberately broken engine (executor/drill/broken.py); "" for the real one.
    break_engine: str = ""
    # A TOML file of HTTP tools (`--tools-file`), pointed at the drill's desk and posted to
    # as well, and which of its tools (`--tools`, comma-separated; "" for its writes).
    tools_file: str = ""
    tools: str = ""
    # An MCP server behind the gateway, posted to as well ("git": mcp-server-git; "" none).
    upstream: str = ""

    def validate(self) -> None:
        if self.steps < 1:
            raise DrillError("--steps must be at least 1")
        if not 1 <= self.workers <= 32:
            raise DrillError("--workers must be between 1 and 32")
        if self.kill_every < 0:
            raise DrillError("--kill-every must be 0 (no kills) or more")
        if self.freeze_every < 0:
            raise DrillError("--freeze-every must be 0 (no freezes) or more")
        if not 1 <= self.batch_size <= 1000:
            raise DrillError("--batch-size must be between 1 and 1000")
        if self.timeout <= 0:
            raise DrillError("--timeout must be positive")
        if not 0 <= self.compensate <= 1:
            raise DrillError("--compensate must be in [0, 1]")
        if self.break_engine and self.break_engine not in BREAKS:
            raise DrillError(f"unknown break {self.break_engine!r}")
        if self.tools and not self.tools_file:
            raise DrillError("--tools names tools of --tools-file FILE: give the file too")
        if self.upstream not in UPSTREAMS:
            raise DrillError(f"--upstream must be one of {', '.join(u for u in UPSTREAMS if u)}")

    def worker_fault_spec(self) -> str:
        """The worker faults as EXECUTOR_FAULTS spells them."""
        return ",".join(f"{point}:{rate}" for point, rate in self.worker_faults.items())


# --- where the drill runs ---------------------------------------------------------------

EMBEDDED_BROKER = "filesystem://"


def embedded_here() -> bool:
    """Whether this process's own broker is the embedded one (a folder, no server)."""
    return "data_folder_in" in settings.CELERY_BROKER_TRANSPORT_OPTIONS


def current_database_url() -> str:
    """The URL of the database this process uses, for worker processes to use too."""
    db = connection.settings_dict
    if connection.vendor == "sqlite":
        return f"sqlite:///{Path(db['NAME']).resolve()}"
    if connection.vendor == "postgresql":
        auth = quote(db.get("USER") or "", safe="")
        if db.get("PASSWORD"):
            auth += ":" + quote(db["PASSWORD"], safe="")
        host = db.get("HOST") or "127.0.0.1"
        port = db.get("PORT") or 5432
        return f"postgres://{auth}@{host}:{port}/{db['NAME']}"
    raise DrillError(f"the drill cannot hand a {connection.vendor} database to its workers")


def same_database(url: str) -> bool:
    import dj_database_url

    wanted = dj_database_url.parse(url)
    current = connection.settings_dict
    keys = ("ENGINE", "NAME", "HOST", "PORT", "USER")
    if wanted["ENGINE"] == "django.db.backends.sqlite3":
        return (
            current["ENGINE"] == wanted["ENGINE"]
            and Path(str(current["NAME"])).resolve() == Path(str(wanted["NAME"])).resolve()
        )
    return all(str(wanted.get(key) or "") == str(current.get(key) or "") for key in keys)


def redact_url(url: str) -> str:
    """The URL without its password, for reports and output."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))


def publishing_broker(broker_url: str, broker_dir: Path | None) -> tuple[str, dict[str, Any]]:
    """The URL and transport options that console/settings.py derives in the workers from
    the environment they are given (`broker_url`, and the embedded broker's folder when
    there is one), for this process to publish alike."""
    if broker_dir is None:
        if broker_url == settings.CELERY_BROKER_URL:
            return broker_url, dict(settings.CELERY_BROKER_TRANSPORT_OPTIONS)
        return broker_url, {}
    # The settings may map the embedded broker to a transport of their own; this
    # process uses the same settings module, so it knows which one.
    url = settings.CELERY_BROKER_URL if embedded_here() else EMBEDDED_BROKER
    options = dict(settings.CELERY_BROKER_TRANSPORT_OPTIONS) if embedded_here() else {}
    folders = {
        "data_folder_in": broker_dir / "messages",
        "data_folder_out": broker_dir / "messages",
        "processed_folder": broker_dir / "processed",
        "control_folder": broker_dir / "control",
    }
    for folder in folders.values():
        folder.mkdir(parents=True, exist_ok=True)
    return url, {
        "store_processed": False,
        "polling_interval": 0.01,
        **options,
        **{key: str(folder) for key, folder in folders.items()},
    }
