"""Real MCP servers behind the gateway, for the tests: `mcp-server-git` (PyPI, in the dev
extras) on a repository of the test's own, and the npm reference servers installed under
tests/upstreams/ (`npm ci`, run by `make test`).

The git repository stages a fresh change after every commit (a post-commit hook), so every
`git_commit` makes exactly one commit: a second submission of one step would show as a
second commit with its message. The hook can also hold the call *after* the commit, while
`slow` exists — the effect happened and its answer is not sent yet. The upstream is started
through a small script that can be told to be down or to hang, and records its pid, so a
test can kill it mid-call.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
NODE_BIN = ROOT / "tests" / "upstreams" / "node_modules" / ".bin"
GIT_SERVER = str(Path(sys.executable).parent / "mcp-server-git")
GIT_IDENTITY = {
    "GIT_AUTHOR_NAME": "stepward",
    "GIT_AUTHOR_EMAIL": "stepward@example.com",
    "GIT_COMMITTER_NAME": "stepward",
    "GIT_COMMITTER_EMAIL": "stepward@example.com",
}

HOOK = """#!/bin/sh
# Stage the next change, so that the next git_commit has one to commit.
date +%s%N >> counter
git add counter
# Hold the call after the commit while `slow` exists (a test kills the upstream meanwhile).
# The server that runs this hook is its parent (GitPython runs hooks itself).
while [ -e "$STEPWARD_STATE/slow" ]; do
  echo $PPID > "$STEPWARD_STATE/in-hook.tmp"
  mv "$STEPWARD_STATE/in-hook.tmp" "$STEPWARD_STATE/in-hook"
  sleep 0.05
done
"""

LAUNCHER = """#!/bin/sh
# Starts the upstream unless told to be down or to hang; records the pid it runs under.
echo $$ > "$STEPWARD_STATE/pid"
if [ -e "$STEPWARD_STATE/down" ]; then echo "down for maintenance" >&2; exit 1; fi
if [ -e "$STEPWARD_STATE/hang" ]; then exec sleep 3600; fi
exec "$@"
"""


def node_server(name: str) -> str:
    """The path of an npm reference server's command (`mcp-server-memory`, …)."""
    path = NODE_BIN / name
    if not path.exists():
        raise AssertionError(
            f"{path} is missing: `make test` installs the npm servers "
            "(npm ci --prefix tests/upstreams)"
        )
    return str(path)


@dataclass
class Upstream:
    """A real upstream process a test controls from outside."""

    state: Path
    launcher: Path

    def command(self, *argv: str) -> list[str]:
        return [str(self.launcher), *argv]

    def env(self, **more: str) -> dict[str, str]:
        return {"STEPWARD_STATE": str(self.state), **more}

    def pid(self) -> int:
        """The pid of the upstream started last (several processes may each run one)."""
        return int((self.state / "pid").read_text())

    def kill(self) -> None:
        os.kill(self.pid(), signal.SIGKILL)

    def kill_the_one_in_the_hook(self) -> None:
        """SIGKILLs the server whose git_commit the hook is holding (`slow`)."""
        self.wait_for("in-hook")
        os.kill(int((self.state / "in-hook").read_text()), signal.SIGKILL)

    def set(self, flag: str, on: bool = True) -> None:
        path = self.state / flag
        if on:
            path.touch()
        else:
            path.unlink(missing_ok=True)

    def wait_for(self, flag: str, seconds: float = 30) -> None:
        wait_until(lambda: (self.state / flag).exists(), seconds, f"{flag} in {self.state}")


def upstream(folder: Path) -> Upstream:
    state = folder / "upstream-state"
    state.mkdir(parents=True, exist_ok=True)
    launcher = folder / "upstream.sh"
    launcher.write_text(LAUNCHER)
    launcher.chmod(0o755)
    return Upstream(state=state, launcher=launcher)


@dataclass
class GitRepo:
    path: Path

    def messages(self) -> list[str]:
        out = subprocess.run(
            ["git", "-C", str(self.path), "log", "--format=%s"],
            capture_output=True,
            text=True,
            check=True,
        )
        return out.stdout.splitlines()

    def commits_with(self, message: str) -> int:
        return self.messages().count(message)


def git_repo(folder: Path, state: Path) -> GitRepo:
    path = folder / "repo"
    path.mkdir(parents=True)
    env = {**os.environ, **GIT_IDENTITY}

    def git(*argv: str) -> None:
        subprocess.run(["git", "-C", str(path), *argv], env=env, check=True, capture_output=True)

    git("init", "-q")
    git("commit", "-q", "--allow-empty", "-m", "init")
    (path / "counter").write_text("0\n")
    git("add", "counter")
    hook = path / ".git" / "hooks" / "post-commit"
    hook.write_text(HOOK.replace("$STEPWARD_STATE", str(state)))
    hook.chmod(0o755)
    return GitRepo(path=path)


def git_upstream_table(
    up: Upstream, repo: GitRepo, *, name: str = "git", **more: Any
) -> dict[str, Any]:
    """The [[upstream]] table a test loads for mcp-server-git on `repo`."""
    table: dict[str, Any] = {
        "name": name,
        "command": up.command(GIT_SERVER, "--repository", str(repo.path)),
        "env": up.env(**GIT_IDENTITY),
        "trust_annotations": True,
        "defaults": {"approval": "never"},
        "timeout": 20,
    }
    table.update(more)
    return table


def wait_until(check: Callable[[], object], seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.05)
    raise AssertionError(f"waited {seconds:g}s for {what}")


def have_git() -> bool:
    return shutil.which("git") is not None


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class EverythingServer:
    """The npm reference server `mcp-server-everything` over streamable HTTP, on a port of
    its own (its `trigger-long-running-operation` takes as long as it is asked to)."""

    def __init__(self, folder: Path) -> None:
        self.port = free_port()
        self.log = folder / "everything.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/mcp"

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> EverythingServer:
        import socket

        with self.log.open("ab") as log:
            self.process = subprocess.Popen(
                [node_server("mcp-server-everything"), "streamableHttp"],
                env={**os.environ, "PORT": str(self.port)},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

        def answering() -> bool:
            with socket.socket() as probe:
                return probe.connect_ex(("127.0.0.1", self.port)) == 0

        wait_until(answering, 30, f"mcp-server-everything on {self.port}")
        return self

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)
