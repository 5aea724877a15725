"""`manage.py up`: the whole product on one machine — web, worker, beat and ticket desk.

Creates a demo workspace, agent and reviewer on first start and prints how to use them.
Children that die are restarted (a drill or fault injection may end a worker on purpose);
Ctrl-C stops everything.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx
from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandParser

from executor import services
from executor.models import Agent


@dataclass
class Child:
    name: str
    argv: list[str]
    process: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    env: dict[str, str] = field(default_factory=dict)

    def start(self) -> None:
        self.process = subprocess.Popen(self.argv, env={**os.environ, **self.env})  # noqa: S603


class Command(BaseCommand):
    help = "Run web, worker, beat and the ticket desk together on this machine."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=8000)
        parser.add_argument("--workers", type=int, default=2, help="worker processes")
        parser.add_argument("--desk-port", type=int, default=8765)
        parser.add_argument("--no-desk", action="store_true", help="do not start the desk")
        parser.add_argument("--no-demo", action="store_true", help="create no demo accounts")

    def handle(self, *args: Any, **options: Any) -> None:
        call_command("collectstatic", interactive=False, verbosity=0)
        token = ""
        if not options["no_demo"]:
            token = self.create_demo(
                public=options["host"] not in ("127.0.0.1", "localhost", "::1")
            )
        if not options["no_desk"]:
            # Children inherit the environment: point the tools at the desk started here,
            # and let `http.get` read it (the demo does), and nothing else.
            os.environ.setdefault("TICKETDESK_URL", f"http://127.0.0.1:{options['desk_port']}")
            os.environ.setdefault(
                "EXECUTOR_HTTP_ALLOWED_HOSTS", urlsplit(os.environ["TICKETDESK_URL"]).netloc
            )
        python = sys.executable
        manage = str(settings.BASE_DIR / "manage.py")
        celery = [python, "-m", "celery", "-A", "console"]
        children = [
            Child(
                "web",
                [
                    python,
                    "-m",
                    "gunicorn",
                    "console.wsgi",
                    "--bind",
                    f"{options['host']}:{options['port']}",
                    "--workers",
                    "2",
                    "--threads",
                    "8",
                    "--worker-class",
                    "gthread",
                    "--access-logfile",
                    "-",
                ],
            ),
            Child(
                "worker",
                [*celery, "worker", "--loglevel", "INFO", "--concurrency", str(options["workers"])],
            ),
            Child("beat", [*celery, "beat", "--loglevel", "INFO"]),
        ]
        if not options["no_desk"]:
            children.append(
                Child(
                    "ticketdesk",
                    [python, manage, "ticketdesk", "--port", str(options["desk_port"])],
                )
            )
        for child in children:
            child.start()
        self.stdout.write(
            self.style.SUCCESS(
                f"Stepward is up: http://{options['host']}:{options['port']}/ "
                f"(API at /api/v1/, docs at /api/v1/docs). Ctrl-C stops it."
            )
        )
        demo = None
        if token and self.wait_for_web(options["host"], options["port"]):
            # Once: a real run for the console to show.
            demo = subprocess.Popen(  # noqa: S603
                [
                    python,
                    "-m",
                    "executor.demo",
                    "--url",
                    f"http://{options['host']}:{options['port']}",
                    "--token",
                    token,
                    "--desk",
                    os.environ.get("TICKETDESK_URL", settings.TICKETDESK_URL),
                ]
            )
        elif token:
            self.stderr.write("the web server did not answer within 60 s: no demo run")
        self.supervise(children)
        if demo is not None and demo.poll() is None:
            demo.terminate()

    def wait_for_web(self, host: str, port: int) -> bool:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://{host}:{port}/api/v1/openapi.json", timeout=2).is_success:
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        return False

    def create_demo(self, *, public: bool) -> str:
        workspace = services.workspace_get_or_create(slug="demo", name="Demo")
        # A well-known password only while the console listens on loopback.
        password = secrets.token_urlsafe(9) if public else "reviewer"
        services.reviewer_create(workspace=workspace, username="reviewer", password=password)
        agent = Agent.objects.filter(workspace=workspace, name="demo-agent").first()
        if agent is None:
            agent, token = services.agent_create(workspace=workspace, name="demo-agent")
        else:
            token = services.agent_rotate_token(agent=agent)
        self.stdout.write(
            f"Demo workspace 'demo': console login reviewer / {password}; "
            "agent 'demo-agent' token (new at every start):"
        )
        self.stdout.write(token)
        return token

    def supervise(self, children: list[Child]) -> None:
        stopping = False

        def stop(signum: int, frame: object) -> None:
            nonlocal stopping
            stopping = True

        signal.signal(signal.SIGINT, stop)
        signal.signal(signal.SIGTERM, stop)
        try:
            while not stopping:
                for child in children:
                    assert child.process is not None
                    code = child.process.poll()
                    if code is not None and not stopping:
                        child.restarts += 1
                        self.stderr.write(
                            f"{child.name} exited with {code}; restarting "
                            f"(restart {child.restarts})"
                        )
                        child.start()
                time.sleep(0.5)
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
