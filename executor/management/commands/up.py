"""`manage.py up`: the whole product on one machine — web, worker, beat and ticket desk.

Checks its ports before it does anything else, then migrates the database; creates an admin
login (when the database has no superuser) and a demo workspace, agent and reviewer, and
prints how to use them; then runs a demo agent (executor/desk/demo.py), once per database: the
demo agent's runs are the mark that it ran. Children that die are restarted (a drill or fault
injection may end a worker on purpose), but one that keeps dying right after it starts
stops everything, naming it and its log. Ctrl-C stops everything.
"""

from __future__ import annotations

import io
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlsplit

import httpx
from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError, CommandParser

from executor.ledger.records import Agent, Run
from executor.services.accounts import (
    admin_create_first,
    agent_create,
    agent_rotate_token,
    agent_set_tools,
    reviewer_create,
    workspace_get_or_create,
)
from executor.services.tools import tools_sync

# A child that exits sooner than this after its start did not start; after this many
# such exits in a row `up` gives up rather than restart it forever.
QUICK_EXIT_SECONDS = 10.0
MAX_QUICK_RESTARTS = 3
TICK_SECONDS = 0.5
WEB_READY_SECONDS = 60.0
LOG_TAIL_LINES = 15

# An HTTP tool defined as data, as an operator would load one: a plain webhook to the
# desk with no idempotency key and no lookup, so a dropped connection leaves an `unknown`
# only a person can settle (the demo makes the desk drop one).
DEMO_TOOL = "demo.open_ticket"
DEMO_AGENT = "demo-agent"
DEMO_TOOL_TOML = """\
[[tool]]
name = "{name}"
description = "Opens a ticket at the ticket desk as a plain webhook: no idempotency key, no lookup (loaded by manage.py up for the demo)"
effect = "write"
method = "POST"
url = "{desk}/tickets"
external_id = "ticket_id"
input_schema = {{ type = "object", required = ["title"], properties = {{ title = {{ type = "string", maxLength = 200 }}, body = {{ type = "string" }} }} }}
"""  # noqa: E501

_output_lock = threading.Lock()


def _relay(name: str, stream: IO[bytes], log: IO[bytes]) -> None:
    """Copies a child's output to its log file and, prefixed with its name, to ours."""
    prefix = f"{name:<10} | ".encode()
    with stream, log:
        for line in iter(stream.readline, b""):
            log.write(line)
            log.flush()
            with _output_lock:
                try:
                    sys.stdout.buffer.write(prefix + line)
                    sys.stdout.buffer.flush()
                except (OSError, ValueError):
                    pass  # our own output is gone; the log file still has it


def spawn(
    name: str, argv: list[str], env: dict[str, str], log_path: Path
) -> subprocess.Popen[bytes]:
    """Starts `argv` with its output appended to `log_path` and shown on ours."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = log_path.open("ab")
    process = subprocess.Popen(  # noqa: S603
        argv,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    assert process.stdout is not None
    threading.Thread(target=_relay, args=(name, process.stdout, log), daemon=True).start()
    return process


@dataclass
class Child:
    name: str
    argv: list[str]
    log_path: Path
    process: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    quick_exits: int = 0
    env: dict[str, str] = field(default_factory=dict)

    def start(self) -> None:
        self.started_at = time.monotonic()
        self.process = spawn(self.name, self.argv, self.env, self.log_path)

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


class ChildCannotStart(Exception):
    def __init__(self, child: Child, code: int) -> None:
        super().__init__(child.name)
        self.child = child
        self.code = code


def port_in_use(host: str, port: int) -> str | None:
    """Why `host:port` cannot be listened on now (what holds it), or None if it can."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except (OSError, UnicodeError) as error:
        return f"cannot use address {host}: {error}"
    with socket.socket(family, kind, proto) as probe:
        # As the servers themselves bind: a port only in TIME_WAIT is free.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as error:
            return error.strerror or str(error)
    return None


def operator_command(command: str) -> str:
    """`command` as the operator can type it here: the `stepward` script installed beside
    this Python (see pyproject.toml), else this Python and manage.py."""
    here = f"{Path.cwd()}{os.sep}"

    def typed(path: Path | str) -> str:
        return str(path).removeprefix(here)

    script = Path(sys.executable).parent / "stepward"
    if script.exists():
        return f"{typed(script)} {command}"
    return f"{typed(sys.executable)} {typed(Path(settings.BASE_DIR) / 'manage.py')} {command}"


class Command(BaseCommand):
    help = "Run web, worker, beat and the ticket desk together on this machine."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument(
            "--port", type=int, default=settings.PORT, help="the console and API (PORT, 8000)"
        )
        parser.add_argument("--workers", type=int, default=2, help="worker processes")
        parser.add_argument(
            "--desk-port",
            type=int,
            default=settings.TICKETDESK_PORT,
            help="the ticket desk (TICKETDESK_PORT, 8765)",
        )
        parser.add_argument("--no-desk", action="store_true", help="do not start the desk")
        parser.add_argument("--no-demo", action="store_true", help="create no demo accounts")
        parser.add_argument(
            "--no-migrate", action="store_true", help="do not migrate the database first"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        # Our own lines, in order with the children's that _relay writes, also when the
        # output is a file or a pipe (a service manager's log), not only on a terminal.
        if isinstance(sys.stdout, io.TextIOWrapper):
            sys.stdout.reconfigure(line_buffering=True)
        host, port, desk_port = options["host"], options["port"], options["desk_port"]
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        with_desk = not options["no_desk"]
        # Before anything starts: a busy port would otherwise show as a server that keeps
        # dying, or worse, as someone else's server answering in ours' place.
        self.check_ports(host, port, desk_port if with_desk else None)
        if not options["no_migrate"]:
            call_command("migrate", interactive=False, verbosity=0)
        call_command("collectstatic", interactive=False, verbosity=0)
        self.create_admin(address)
        if with_desk:
            # Children inherit the environment: point the tools at the desk started here,
            # and let `http.get` read it (the demo does), and nothing else.
            os.environ.setdefault("TICKETDESK_URL", f"http://127.0.0.1:{desk_port}")
            os.environ.setdefault(
                "EXECUTOR_HTTP_ALLOWED_HOSTS", urlsplit(os.environ["TICKETDESK_URL"]).netloc
            )
        token = ""
        demo_ran = False
        if not options["no_demo"]:
            if with_desk:
                self.load_demo_tool(os.environ["TICKETDESK_URL"])
            token = self.create_demo(public=host not in ("127.0.0.1", "localhost", "::1"))
            demo_ran = Run.objects.filter(workspace__slug="demo", agent__name=DEMO_AGENT).exists()
        log_dir = settings.VAR_DIR / "log"
        python = sys.executable
        manage = str(settings.BASE_DIR / "manage.py")
        celery = [python, "-m", "celery", "-A", "console"]
        # An event loop a process (console/asgi.py): long-polls and slow request bodies
        # hold no thread there, so no client can starve the others.
        web = [
            python,
            "-m",
            "gunicorn",
            "console.asgi",
            "--bind",
            address,
            "--workers",
            "2",
            "--worker-class",
            "uvicorn_worker.UvicornWorker",
            "--access-logfile",
            "-",
        ]
        children = [
            Child("web", web, log_dir / "web.log"),
            Child(
                "worker",
                [*celery, "worker", "--loglevel", "INFO", "--concurrency", str(options["workers"])],
                log_dir / "worker.log",
            ),
            Child("beat", [*celery, "beat", "--loglevel", "INFO"], log_dir / "beat.log"),
        ]
        if with_desk:
            children.append(
                Child(
                    "ticketdesk",
                    [python, manage, "ticketdesk", "--port", str(desk_port)],
                    log_dir / "ticketdesk.log",
                )
            )
        self.stdout.write(
            f"starting {', '.join(c.name for c in children)}; their logs are in {log_dir}"
        )
        demo: list[subprocess.Popen[bytes]] = []

        def ready() -> None:
            self.stdout.write(
                self.style.SUCCESS(
                    f"Stepward is up: http://{address}/ "
                    f"(API at /api/v1/, docs at /api/v1/docs, admin at /admin/). "
                    "Ctrl-C stops it."
                )
            )
            if demo_ran:
                self.stdout.write(
                    "The demo ran on this database before: its runs are in the console, and "
                    "it is not run again."
                )
            elif token:
                # Once per database: real runs for the console to show.
                demo.append(
                    spawn(
                        "demo",
                        [
                            python,
                            "-m",
                            "executor.desk.demo",
                            "--url",
                            f"http://{address}",
                            "--token",
                            token,
                            "--desk",
                            os.environ.get("TICKETDESK_URL", settings.TICKETDESK_URL),
                        ],
                        {},
                        log_dir / "demo.log",
                    )
                )

        for child in children:
            child.start()
        try:
            self.supervise(children, web_url=f"http://{address}", on_ready=ready)
        except ChildCannotStart as failed:
            raise CommandError(
                f"{failed.child.name} could not start: it exited {failed.child.quick_exits} "
                f"times within {QUICK_EXIT_SECONDS:g} s of starting (last exit status "
                f"{failed.code}), so everything was stopped. Its log: {failed.child.log_path}\n"
                f"--- the end of {failed.child.log_path.name} ---\n{failed.child.log_tail()}"
            ) from None
        finally:
            for process in demo:
                if process.poll() is None:
                    process.terminate()

    def check_ports(self, host: str, port: int, desk_port: int | None) -> None:
        problems = []
        for name, number in (("PORT", port), ("TICKETDESK_PORT", desk_port)):
            if number is not None and not 0 < number < 65536:
                problems.append(f"{name}={number} is not a port (1 to 65535)")
        if problems:
            raise CommandError("nothing was started: " + "; ".join(problems) + ".")
        if desk_port == port:
            raise CommandError(
                f"the console and the ticket desk cannot share port {port}: "
                f"choose another for the desk, e.g. TICKETDESK_PORT={port + 1} make run"
            )
        taken = {port, desk_port}

        def free_after(host: str, start: int) -> int:
            """A port to suggest: the next one that is free now (or just the next one)."""
            for candidate in range(start + 1, min(start + 50, 65536)):
                if candidate not in taken and port_in_use(host, candidate) is None:
                    return candidate
            return start + 1

        held = port_in_use(host, port)
        if held:
            other = free_after(host, port)
            problems.append(
                f"port {port} on {host} is already in use ({held}), by another Stepward or "
                f"another server: stop it, or choose another port: PORT={other} make run "
                f"(or manage.py up --port {other})."
            )
        if desk_port is not None:
            held = port_in_use("127.0.0.1", desk_port)
            if held:
                other = free_after("127.0.0.1", desk_port)
                problems.append(
                    f"the ticket desk's port {desk_port} on 127.0.0.1 is already in use "
                    f"({held}): stop what holds it, or choose another port: "
                    f"TICKETDESK_PORT={other} make run (or manage.py up --desk-port {other})."
                )
        if problems:
            # One sentence a problem, a line each.
            raise CommandError(
                "nothing was started, not even the database's migration:\n"
                + "\n".join(f"- {problem}" for problem in problems)
            )

    def create_admin(self, address: str) -> None:
        password = admin_create_first(username="admin")
        if password:
            self.stdout.write(
                f"Admin login (made once, shown once): admin / {password} at "
                f"http://{address}/admin/ (another password: "
                f"{operator_command('changepassword admin')})"
            )
        else:
            self.stdout.write(
                "Admin: sign in at /admin/ as a superuser "
                f"(a new one: {operator_command('createsuperuser')})"
            )

    def load_demo_tool(self, desk_url: str) -> None:
        """Loads the demo's HTTP tool with `manage.py load_tools`, in a process that reads
        the allow-list `up` gives its children (this process read its settings before)."""
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "demo-tools.toml"
            path.write_text(DEMO_TOOL_TOML.format(name=DEMO_TOOL, desk=desk_url.rstrip("/")))
            loaded = subprocess.run(  # noqa: S603
                [sys.executable, str(settings.BASE_DIR / "manage.py"), "load_tools", str(path)],
                capture_output=True,
                text=True,
                check=False,
            )
        if loaded.returncode != 0:
            self.stderr.write(
                f"the demo's tool {DEMO_TOOL} was not loaded, so the demo shows no unknown "
                f"outcome that needs a person:\n{loaded.stderr.strip()}"
            )

    def create_demo(self, *, public: bool) -> str:
        workspace = workspace_get_or_create(slug="demo", name="Demo")
        # A well-known password only while the console listens on loopback.
        password = secrets.token_urlsafe(9) if public else "reviewer"
        reviewer_create(workspace=workspace, username="reviewer", password=password)
        tools_sync()
        agent = Agent.objects.filter(workspace=workspace, name=DEMO_AGENT).first()
        if agent is None:
            agent, token = agent_create(workspace=workspace, name=DEMO_AGENT)
        else:
            token = agent_rotate_token(agent=agent)
            # The demo agent may use every tool, the demo's own included.
            agent_set_tools(agent=agent, tools=None)
        self.stdout.write(
            f"Demo workspace 'demo': console login reviewer / {password}; "
            "agent 'demo-agent' token (new at every start):"
        )
        self.stdout.write(token)
        return token

    def supervise(
        self, children: list[Child], *, web_url: str, on_ready: Callable[[], None]
    ) -> None:
        """Restarts children that end, until Ctrl-C or SIGTERM; raises ChildCannotStart
        for one that ended right after its start too many times in a row. Calls
        `on_ready` once, when the web server first answers."""
        stopping = threading.Event()

        def stop(signum: int, frame: object) -> None:
            stopping.set()

        signal.signal(signal.SIGINT, stop)
        signal.signal(signal.SIGTERM, stop)
        started = time.monotonic()
        answered = warned = False
        try:
            while not stopping.is_set():
                for child in children:
                    assert child.process is not None
                    code = child.process.poll()
                    if code is None or stopping.is_set():
                        continue
                    quick = time.monotonic() - child.started_at < QUICK_EXIT_SECONDS
                    child.quick_exits = child.quick_exits + 1 if quick else 0
                    if child.quick_exits > MAX_QUICK_RESTARTS:
                        raise ChildCannotStart(child, code)
                    self.stderr.write(
                        f"{child.name} exited with {code}; restarting it (log: {child.log_path})"
                    )
                    child.start()
                if not answered and self.web_answers(web_url):
                    answered = True
                    on_ready()
                elif not answered and not warned and time.monotonic() - started > WEB_READY_SECONDS:
                    warned = True
                    self.stderr.write(
                        f"the web server has not answered at {web_url} for "
                        f"{WEB_READY_SECONDS:g} s; see {children[0].log_path}"
                    )
                stopping.wait(TICK_SECONDS)
        finally:
            for child in children:
                if child.process and child.process.poll() is None:
                    child.process.terminate()
            deadline = time.monotonic() + 15
            for child in children:
                if child.process is None:
                    continue
                try:
                    child.process.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    child.process.kill()

    @staticmethod
    def web_answers(url: str) -> bool:
        try:
            return httpx.get(f"{url}/api/v1/openapi.json", timeout=2).is_success
        except httpx.HTTPError:
            return False
