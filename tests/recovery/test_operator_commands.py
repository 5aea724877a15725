"""Every operator command the docs show, run as written (issue 24, issue 20.3).

Each test works in a copy of the checkout, made as a fresh clone would be, whose `.venv` is
this one's; its key is made by `make secret-key`, the rule `make run` uses. Every command is a
real process started with a fresh shell's environment (PATH, HOME and nothing else): no
SECRET_KEY, SECRET_KEY_FILE, DATABASE_URL or broker is set by hand. So each command finds
`var/secret.key`, the SQLite database and the embedded broker by itself, or the test fails.

The one thing chosen as a user who already runs something on 8000 and 8765 would: the ports,
by the documented `PORT` and `TICKETDESK_PORT` (so the copy's `examples/desk-tools.toml`
names that desk port, as such a user would write it).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import sqlite3
import stat
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from django.conf import settings

from stepward_client.client import SETTLED
from tests.support.processes import wait_until

ROOT = Path(settings.BASE_DIR)
# What a clone holds that the commands read (tests, docs and bench are not needed).
CHECKOUT = (
    "console",
    "executor",
    "stepward_client",
    "templates",
    "static",
    "examples",
    "manage.py",
    "Makefile",
)
UP = [".venv/bin/python", "manage.py", "up"]
UP_SECONDS = 240.0
DEMO_SECONDS = 300.0
COMMAND_SECONDS = 120.0
# A drill of 20 steps, its crashes and leases included (about 100 s on a loaded machine).
DRILL_SECONDS = 600.0
# Celery says this, and only this, when its worker runs as root (as in CI's container): an
# advice about the machine, not about Stepward. Anywhere else it is not said.
ROOT_ADVICE = ("SecurityWarning: You're running the worker with superuser privileges",)
ROOT_ADVICE_TRACE = "_warn_or_raise_security_error("


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


PORT, DESK_PORT = free_port(), free_port()


def shell_env() -> dict[str, str]:
    """A fresh login shell's environment: nothing of Stepward's set but the ports."""
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": os.environ.get("HOME", "/root"),
        "LANG": "C.UTF-8",
        "PORT": str(PORT),
        "TICKETDESK_PORT": str(DESK_PORT),
    }


def make_clone(where: Path) -> Path:
    clone = where / "stepward"
    clone.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in CHECKOUT:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, clone / name, ignore=ignore)
        else:
            shutil.copy2(source, clone / name)
    (clone / ".venv").symlink_to((ROOT / ".venv").resolve())
    tools = clone / "examples" / "desk-tools.toml"
    tools.write_text(tools.read_text().replace("127.0.0.1:8765", f"127.0.0.1:{DESK_PORT}"))
    made = subprocess.run(
        ["make", "--no-print-directory", "secret-key"],
        cwd=clone,
        env=shell_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert made.returncode == 0, made.stderr
    key = clone / "var" / "secret.key"
    assert key.stat().st_size > 0
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    return clone


def manage(
    clone: Path,
    *argv: str,
    stdin: str | None = None,
    cwd: Path | None = None,
    timeout: float = COMMAND_SECONDS,
) -> subprocess.CompletedProcess[str]:
    """`.venv/bin/python manage.py ARGV`, typed in the clone (or in `cwd`)."""
    return subprocess.run(
        [".venv/bin/python", "manage.py", *argv],
        cwd=cwd or clone,
        env=shell_env(),
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        # No controlling terminal: getpass reads the passwords from stdin, as a script's.
        start_new_session=True,
    )


def stepward(clone: Path, *argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """`stepward ARGV` typed in `cwd`: the console script pip installs (pyproject.toml's
    [project.scripts]) imports `console.cli` through the project's install, which points at
    the checkout; here the checkout is put on the path the same way."""
    script = f"import sys; sys.path.insert(0, {str(clone)!r}); from console.cli import main; main()"
    return subprocess.run(
        [str(clone / ".venv" / "bin" / "python"), "-c", script, *argv],
        cwd=cwd,
        env=shell_env(),
        capture_output=True,
        text=True,
        timeout=COMMAND_SECONDS,
        check=False,
    )


def false_alarms(output: str) -> list[str]:
    """Lines of start-up output that look like a problem: a warning, an error, a traceback."""
    found = []
    for line in output.splitlines():
        if any(advice in line for advice in ROOT_ADVICE) and os.geteuid() == 0:
            continue
        if ROOT_ADVICE_TRACE in line and os.geteuid() == 0:
            continue
        if re.search(r"warn|error|traceback|exception", line, re.IGNORECASE):
            found.append(line)
    return found


@dataclass
class Up:
    """`.venv/bin/python manage.py up` in a clone, its output kept in a file."""

    clone: Path
    port: int = PORT
    desk_port: int = DESK_PORT
    process: subprocess.Popen[str] | None = None
    starts: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def out(self) -> Path:
        return self.clone / f"up-{self.starts}.out"

    @property
    def err(self) -> Path:
        return self.clone / f"up-{self.starts}.err"

    def start(self) -> None:
        self.starts += 1
        with self.out.open("w") as out, self.err.open("w") as err:
            self.process = subprocess.Popen(
                UP,
                cwd=self.clone,
                env=shell_env(),
                stdout=out,
                stderr=err,
                text=True,
                start_new_session=True,
            )
        wait_until(
            lambda: "Stepward is up" in self.out.read_text(),
            seconds=UP_SECONDS,
            what="up to answer",
            diagnose=self.diagnose,
        )

    def stop(self) -> None:
        process = self.process
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        self.process = None

    def diagnose(self) -> str:
        return (
            f"--- up stdout ---\n{self.out.read_text()}\n--- up stderr ---\n{self.err.read_text()}"
        )


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_clone(tmp_path_factory.mktemp("clone"))


@pytest.fixture(scope="module")
def up(clone: Path) -> Iterator[Up]:
    """The clone's `up`, started once with its demo; the tests below share it."""
    running = Up(clone)
    running.start()
    demo_log = clone / "var" / "log" / "demo.log"
    wait_until(
        lambda: demo_log.exists() and "demo: done" in demo_log.read_text(),
        seconds=DEMO_SECONDS,
        what="the demo to finish",
        diagnose=lambda: f"{running.diagnose()}\n--- demo ---\n{demo_log.read_text()}",
    )
    try:
        yield running
    finally:
        running.stop()


def demo_runs(clone: Path) -> int:
    with contextlib.closing(sqlite3.connect(clone / "var" / "stepward.sqlite3")) as db:
        (count,) = db.execute(
            "SELECT count(*) FROM executor_run JOIN executor_agent "
            "ON executor_run.agent_id = executor_agent.id WHERE executor_agent.name = 'demo-agent'"
        ).fetchone()
    return int(count)


# --- up ---------------------------------------------------------------------------------------


def test_a_busy_port_stops_up_before_it_migrates(tmp_path: Path) -> None:
    clone = make_clone(tmp_path)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        done = manage(clone, "up", "--port", str(port), "--desk-port", str(free_port()))

    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert lines[0] == "CommandError: nothing was started, not even the database's migration:"
    assert len(lines) == 2, done.stderr
    problem = lines[1]
    assert problem.startswith(f"- port {port} on 127.0.0.1 is already in use"), problem
    # One sentence: it ends with its only full stop.
    assert problem.endswith("."), problem
    assert ". " not in problem, problem
    assert re.search(r"choose another port: PORT=\d+ make run", problem)
    database = clone / "var" / "stepward.sqlite3"
    if database.exists():
        with contextlib.closing(sqlite3.connect(database)) as db:
            tables = db.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall()
        assert tables == [], "nothing was migrated"
    assert not (clone / "var" / "log").exists(), "no child was started"


def test_up_starts_without_a_false_alarm(up: Up) -> None:
    output = up.out.read_text()
    demo = (up.clone / "var" / "log" / "demo.log").read_text()

    assert up.err.read_text() == "", "up's own stderr is for problems"
    assert false_alarms(output) == [], output
    # The demo's success reads as one, its planned faults as planned.
    assert re.search(r"demo: ticket-1: completed \(external id \d+\); an earlier attempt", demo)
    assert "demo: note-alan: unknown, as planned" in demo
    assert "demo: escalate-4471: dead letter, as planned" in demo
    assert "ToolError" not in demo


def test_the_demo_runs_once_per_database(up: Up) -> None:
    runs = demo_runs(up.clone)
    assert runs == 2  # the nightly digest and the refund follow-ups

    up.stop()
    up.start()
    wait_until(
        lambda: "not run again" in up.out.read_text(),
        seconds=UP_SECONDS,
        what="up to say the demo ran before",
        diagnose=up.diagnose,
    )

    assert "The demo ran on this database before" in up.out.read_text()
    assert demo_runs(up.clone) == runs
    assert (up.clone / "var" / "log" / "demo.log").read_text().count("demo: done") == 1
    assert up.err.read_text() == ""
    assert false_alarms(up.out.read_text()) == []


# --- the operator commands, beside a running `up` ---------------------------------------------


def test_changepassword_and_create_reviewer(up: Up) -> None:
    changed = manage(up.clone, "changepassword", "admin", stdin="Sq7-ledger-pass\n" * 2)
    assert changed.returncode == 0, changed.stderr
    assert "Password changed successfully for user 'admin'" in changed.stdout

    made = manage(
        up.clone, "create_reviewer", "carol", "--workspace", "demo", "--password", "carol-pw-9"
    )
    assert made.returncode == 0, made.stderr
    with httpx.Client(base_url=up.url) as browser:
        page = browser.get("/accounts/login/")
        signed_in = browser.post(
            "/accounts/login/",
            data={
                "username": "carol",
                "password": "carol-pw-9",
                "csrfmiddlewaretoken": browser.cookies["csrftoken"],
            },
            headers={"Referer": f"{up.url}/accounts/login/"},
        )
    assert page.status_code == 200
    assert signed_in.status_code == 302, signed_in.text[:500]


def test_the_docs_desk_tools_load_and_run_as_written(up: Up) -> None:
    loaded = manage(up.clone, "load_tools", "examples/desk-tools.toml")
    assert loaded.returncode == 0, loaded.stderr
    assert "examples/desk-tools.toml: loaded" in loaded.stdout

    agent = manage(up.clone, "create_agent", "ops-bot", "--workspace", "demo")
    assert agent.returncode == 0, agent.stderr
    token = agent.stdout.strip().splitlines()[-1]
    headers = {"Authorization": f"Bearer {token}"}
    with httpx.Client(base_url=f"{up.url}/api/v1", headers=headers, timeout=30) as api:
        run = api.post("/runs", json={"name": "docs", "key": "docs-1"})
        assert run.status_code == 201, run.text
        step = api.post(
            f"/runs/{run.json()['id']}/steps",
            json={"key": "t1", "tool": "desk.open_ticket", "input": {"title": "As written"}},
        )
        assert step.status_code == 201, step.text
        step_id = step.json()["id"]

        def settled() -> dict[str, object] | None:
            now = api.get(f"/steps/{step_id}").json()
            return now if now["state"] in SETTLED else None

        final = wait_until(settled, seconds=120, what="the desk tool's step to settle")
    # The workers read ${DESK_TOKEN} (the demo desk's default) and may reach the desk.
    assert final["state"] == "completed", final["failure"]
    tickets = httpx.get(
        f"http://127.0.0.1:{up.desk_port}/tickets", params={"client_ref": final["operation_id"]}
    ).json()
    assert tickets["count"] == 1


def test_load_tools_refuses_an_unset_variable_naming_it_and_the_tool(up: Up) -> None:
    tools = up.clone / "crm-tools.toml"
    tools.write_text(
        "[[tool]]\n"
        'name = "crm.create"\n'
        'effect = "write"\n'
        f'url = "http://127.0.0.1:{up.desk_port}/tickets"\n'
        'headers = { Authorization = "Bearer ${CRM_TOKEN}" }\n'
    )

    refused = manage(up.clone, "load_tools", "crm-tools.toml")

    assert refused.returncode != 0
    assert "tool crm.create: ${CRM_TOKEN} (in 'headers') is not set in this environment" in (
        refused.stderr
    )
    assert "nothing was loaded" in refused.stderr
    listed = manage(up.clone, "load_tools", "--check", "examples/desk-tools.toml")
    assert "crm.create" not in listed.stdout


def test_tool_policy_sweep_verify_ledger_and_migrate(up: Up) -> None:
    policy = manage(up.clone, "tool_policy", "demo", "echo", "--approval", "never")
    assert policy.returncode == 0, policy.stderr

    swept = manage(up.clone, "sweep")
    assert swept.returncode == 0, swept.stderr
    assert "recovered=" in swept.stdout or "another sweeper holds the lease" in swept.stdout

    verified = manage(up.clone, "verify_ledger")
    assert verified.returncode == 0, verified.stdout + verified.stderr

    migrated = manage(up.clone, "migrate")
    assert migrated.returncode == 0, migrated.stderr
    assert "No migrations to apply" in migrated.stdout


def test_ticketdesk_serves_on_the_port_it_is_given(up: Up) -> None:
    port = free_port()
    desk = subprocess.Popen(
        [".venv/bin/python", "manage.py", "ticketdesk", "--port", str(port)],
        cwd=up.clone,
        env=shell_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:

        def answers() -> bool:
            try:
                return httpx.get(f"http://127.0.0.1:{port}/stats", timeout=2).is_success
            except httpx.HTTPError:
                return False

        wait_until(answers, seconds=COMMAND_SECONDS, what="the desk to answer")
    finally:
        desk.terminate()
        desk.wait(timeout=30)


def test_the_stepward_script_runs_from_any_directory(up: Up, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    verified = stepward(up.clone, "verify_ledger", cwd=elsewhere)
    made = stepward(up.clone, "create_agent", "far-bot", "--workspace", "demo", cwd=elsewhere)
    usage = stepward(up.clone, "help", "changepassword", cwd=elsewhere)

    assert verified.returncode == 0, verified.stderr
    assert made.returncode == 0, made.stderr
    assert made.stdout.strip().splitlines()[-1].startswith("sw_")
    assert usage.stdout.startswith("usage: stepward changepassword")
    assert not (elsewhere / "var").exists(), "the checkout's var/ is used, wherever it runs"


def test_an_mcp_server_goes_behind_stepward_as_written(up: Up, tmp_path: Path) -> None:
    # The docs' repository is /tmp/stepward-demo-repo; this test's is its own.
    repo = tmp_path / "stepward-demo-repo"
    repo.mkdir()
    upstream = up.clone / "examples" / "git-upstream.toml"
    upstream.write_text(upstream.read_text().replace("/tmp/stepward-demo-repo", str(repo)))
    git = ["git", "-C", str(repo)]
    subprocess.run([*git, "init"], env=shell_env(), capture_output=True, check=True)
    (repo / "README.md").write_text("hello\n")
    subprocess.run([*git, "add", "README.md"], env=shell_env(), capture_output=True, check=True)

    loaded = manage(up.clone, "load_tools", "examples/git-upstream.toml")
    agent = manage(
        up.clone,
        "create_agent",
        "git-bot",
        "--workspace",
        "demo",
        "--tools",
        "git.git_status,git.git_commit",
    )

    assert loaded.returncode == 0, loaded.stderr
    assert re.search(r"upstream git: \d+ tool\(s\): .*git_commit", loaded.stdout), loaded.stdout
    assert agent.returncode == 0, agent.stderr
    assert agent.stdout.strip().splitlines()[-1].startswith("sw_")


def test_a_drill_runs_on_a_database_of_its_own(up: Up) -> None:
    database = f"sqlite:///{up.clone}/var/drill.sqlite3"

    refused = manage(up.clone, "drill", "--steps", "5")
    drilled = manage(
        up.clone,
        "drill",
        "--database",
        database,
        "--steps",
        "20",
        "--workers",
        "1",
        "--tools-file",
        "examples/desk-tools.toml",
        timeout=DRILL_SECONDS,
    )

    # The console's own database holds the demo's open runs: a drill there would crash them.
    assert refused.returncode != 0
    assert "run drills on a database of their own (--database URL)" in refused.stderr
    assert drilled.returncode == 0, drilled.stdout[-3000:] + drilled.stderr
    assert "verdict: PASSED" in drilled.stdout
    # ...and its report is recorded in the console's database too (record_drill).
    assert re.search(r"recorded as drill \d+ in sqlite:.*/var/stepward\.sqlite3", drilled.stdout)


# --- MCP over stdio, as a desktop assistant starts it ---------------------------------------------


async def desktop_session(config: dict[str, object], token: str, cwd: Path) -> list[str]:
    """Starts the server of a desktop assistant's configuration as such an assistant does
    (the official SDK's stdio client: the configured command, args and env, with the SDK's
    default environment and no other), lists its tools and calls one; its stderr goes to
    `cwd / "mcp.err"`."""
    from mcp import ClientSession, StdioServerParameters
    from mcp.client.stdio import stdio_client

    server = config["mcpServers"]["stepward"]  # type: ignore[index]
    params = StdioServerParameters(
        command=server["command"],
        args=server["args"],
        env={**server["env"], "STEPWARD_TOKEN": token},
        cwd=str(cwd),
    )
    with (cwd / "mcp.err").open("w") as errlog:
        async with (
            stdio_client(params, errlog=errlog) as (read, write),
            ClientSession(read, write) as session,
        ):
            await session.initialize()
            listed = await session.list_tools()
            answer = await session.call_tool("echo", {"key": "desktop-1", "text": "hello"})
            assert answer.structured_content is not None
            assert answer.structured_content["key"] == "desktop-1"
            return [tool.name for tool in listed.tools]


def test_the_desktop_configuration_runs_as_written(up: Up, tmp_path: Path) -> None:
    made = manage(up.clone, "create_agent", "desk-assistant", "--workspace", "demo")
    token = made.stdout.strip().splitlines()[-1]
    text = (up.clone / "examples" / "mcp-desktop.json").read_text()
    # The one thing a user edits: where their checkout is.
    config = json.loads(text.replace("/path/to/stepward", str(up.clone)))
    assert config["mcpServers"]["stepward"]["env"].keys() == {"STEPWARD_TOKEN"}

    tools = asyncio.run(desktop_session(config, token, tmp_path))

    assert {"echo", "step_status", "run_report"} <= set(tools)
    assert (tmp_path / "mcp.err").read_text() == "", "a desktop client shows stderr as errors"
