"""The README and docs/ run as written (issue 24, item 7).

Every fenced block marked `<!-- runnable -->` on the line before it — shell, Python or TOML —
is run against a live `manage.py up` started as `make run` starts it: a fresh var folder
with its own `secret.key`, SQLite, the embedded broker, and no SECRET_KEY, DATABASE_URL or
broker in the environment. Shell blocks run with bash from the checkout, with the token `up`
printed as TOKEN and STEPWARD_TOKEN (what the docs tell a user to set); Python blocks with
the virtualenv's Python; a TOML block is written to a file and loaded with `load_tools`.
The docs' ports (8000 and 8765) become the ones this test's `up` listens on.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from django.conf import settings

from tests.recovery.test_up import free_port
from tests.support.processes import wait_until

ROOT = Path(settings.BASE_DIR)
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARK = "<!-- runnable -->"
FENCE = re.compile(r"^```(\w*)\s*$")
START_SECONDS = 300.0
BLOCK_SECONDS = 180

# What a user's shell does not hold: `make run` decides these, or nobody sets them.
NOT_A_USERS = (
    "SECRET_KEY",
    "SECRET_KEY_FILE",
    "DATABASE_URL",
    "CELERY_BROKER_URL",
    "CELERY_QUEUE",
    "TICKETDESK_URL",
    "EXECUTOR_HTTP_ALLOWED_HOSTS",
    "DJANGO_SETTINGS_MODULE",
)


@dataclass(frozen=True)
class Block:
    document: str
    line: int
    language: str
    text: str

    @property
    def name(self) -> str:
        return f"{self.document}:{self.line}"


def runnable_blocks() -> list[Block]:
    found = []
    for document in DOCUMENTS:
        lines = document.read_text().splitlines()
        for number, line in enumerate(lines):
            if line.strip() != MARK:
                continue
            opening = FENCE.match(lines[number + 1]) if number + 1 < len(lines) else None
            assert opening, f"{document.name}:{number + 1}: {MARK} must come right before a fence"
            end = next(i for i in range(number + 2, len(lines)) if lines[i].startswith("```"))
            found.append(
                Block(
                    document=str(document.relative_to(ROOT)),
                    line=number + 2,
                    language=opening.group(1),
                    text="\n".join(lines[number + 2 : end]) + "\n",
                )
            )
    return found


BLOCKS = runnable_blocks()


@dataclass
class Up:
    port: int
    desk_port: int
    token: str
    env: dict[str, str]
    var: Path

    def localize(self, text: str) -> str:
        """The block as a user of these ports runs it: the examples it names are copies
        pointed at them (as such a user edits them)."""
        ported = re.sub(r"\b8765\b", str(self.desk_port), re.sub(r"\b8000\b", str(self.port), text))
        return ported.replace("examples/", f"{self.var / 'examples'}/")


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    var = tmp_path_factory.mktemp("var")
    (var / "secret.key").write_text(secrets.token_urlsafe(48))
    (var / "secret.key").chmod(0o600)
    env = {key: value for key, value in os.environ.items() if key not in NOT_A_USERS}
    env.update(
        STEPWARD_VAR_DIR=str(var),
        STEPWARD_BROKER_DIR=str(var / "broker"),
        PYTHONUNBUFFERED="1",
    )
    port, desk_port = free_port(), free_port()
    # As a user who chose the ports with `PORT=... TICKETDESK_PORT=... make run` keeps them.
    env.update(PORT=str(port), TICKETDESK_PORT=str(desk_port), PYTHONPATH=str(ROOT))
    migrate = subprocess.run(
        [sys.executable, "manage.py", "migrate", "--no-input"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert migrate.returncode == 0, migrate.stderr
    output = var / "up.out"
    with output.open("w") as out:
        process = subprocess.Popen(
            [sys.executable, "manage.py", "up", "--port", str(port), "--desk-port", str(desk_port)],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
    try:

        def started() -> str | None:
            lines = output.read_text().splitlines()
            for number, line in enumerate(lines[:-1]):
                if "token (new at every start)" in line:
                    token = lines[number + 1].strip()
                    try:
                        httpx.get(f"http://127.0.0.1:{port}/api/v1/tools", timeout=5)
                    except httpx.HTTPError:
                        return None
                    return token
            return None

        token = wait_until(
            started,
            seconds=START_SECONDS,
            what="manage.py up to answer and print the demo agent's token",
            diagnose=output.read_text,
            tick=0.5,
        )
        assert isinstance(token, str)
        env.update(TOKEN=token, STEPWARD_TOKEN=token)
        (var / "examples").mkdir()
        for example in (ROOT / "examples").iterdir():
            ported = re.sub(r"\b8765\b", str(desk_port), example.read_text())
            (var / "examples" / example.name).write_text(ported)
        yield Up(port=port, desk_port=desk_port, token=token, env=env, var=var)
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def test_the_docs_mark_blocks_to_run() -> None:
    names = {block.document for block in BLOCKS}
    assert "README.md" in names
    assert {block.language for block in BLOCKS} >= {"sh", "python", "toml"}


@pytest.mark.parametrize("block", BLOCKS, ids=[block.name for block in BLOCKS])
def test_a_runnable_block_runs_as_written(block: Block, up: Up, tmp_path: Path) -> None:
    text = up.localize(block.text)
    if block.language == "toml":
        path = tmp_path / "block.toml"
        path.write_text(text)
        command = [str(ROOT / ".venv" / "bin" / "python"), "manage.py", "load_tools", str(path)]
    elif block.language == "python":
        path = tmp_path / "block.py"
        path.write_text(text)
        command = [str(ROOT / ".venv" / "bin" / "python"), str(path)]
    else:
        assert block.language in {"sh", "bash", "shell"}, block.language
        command = ["bash", "-euo", "pipefail", "-c", text]
    ran = subprocess.run(
        command,
        cwd=ROOT,
        env=up.env,
        capture_output=True,
        text=True,
        timeout=BLOCK_SECONDS,
        check=False,
    )
    assert ran.returncode == 0, f"{block.name} exited {ran.returncode}:\n{ran.stdout}\n{ran.stderr}"
    assert "Traceback" not in ran.stderr, ran.stderr


def test_every_link_in_the_docs_leads_to_a_file() -> None:
    broken = []
    for document in DOCUMENTS:
        for target in re.findall(r"\]\(([^)\s]+)\)", document.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            if not (document.parent / target.split("#")[0]).exists():
                broken.append(f"{document.relative_to(ROOT)}: {target}")
    assert not broken, broken
