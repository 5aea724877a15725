"""An MCP upstream in the drill (`drill --upstream git`): `mcp-server-git` behind the gateway,
on a repository of the drill's own, its `git_commit` posted to beside the desk's tools.

The repository stages a fresh change after every commit (a post-commit hook), so every
`git_commit` that reaches the server makes exactly one commit, with the step's own message:
a step submitted twice would show as two commits with its message. The workers crash at the
interruption points as for every tool; a commit whose answer was lost with its worker is
`unknown` and waits for a reviewer, who sees what was sent to which upstream (§7, §13.3).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from executor.drill.config import DrillError

UPSTREAM = "git"
TOOL = "git.git_commit"
IDENTITY = {
    "GIT_AUTHOR_NAME": "stepward-drill",
    "GIT_AUTHOR_EMAIL": "drill@stepward.invalid",
    "GIT_COMMITTER_NAME": "stepward-drill",
    "GIT_COMMITTER_EMAIL": "drill@stepward.invalid",
}
GIT = shutil.which("git") or "git"
# Stages the next change, so that the next git_commit always has one to commit.
HOOK = """#!/bin/sh
date +%s%N >> counter
git add counter
"""


def server_command() -> str:
    """mcp-server-git beside this Python (the dev extras install it), else on PATH."""
    beside = Path(sys.executable).parent / "mcp-server-git"
    found = str(beside) if beside.exists() else shutil.which("mcp-server-git")
    if not found:
        raise DrillError(
            "--upstream git needs mcp-server-git (pip install mcp-server-git; the dev extras "
            "install it)"
        )
    if shutil.which("git") is None:
        raise DrillError("--upstream git needs git on PATH")
    return found


def make_repository(path: Path, hook: str = HOOK) -> Path:
    """A repository with one commit, a staged change and the hook that stages the next."""
    path.mkdir(parents=True)
    env = {**os.environ, **IDENTITY}

    def git(*argv: str) -> None:
        subprocess.run(  # noqa: S603 - our own arguments
            [GIT, "-C", str(path), *argv], env=env, check=True, capture_output=True
        )

    git("init", "-q")
    git("commit", "-q", "--allow-empty", "-m", "drill: the repository's start")
    (path / "counter").write_text("0\n")
    git("add", "counter")
    hook_path = path / ".git" / "hooks" / "post-commit"
    hook_path.write_text(hook)
    hook_path.chmod(0o755)
    return path


def upstream_table(repository: Path, command: list[str]) -> dict[str, Any]:
    """The [[upstream]] table the drill loads: annotations trusted, commits unapproved."""
    return {
        "name": UPSTREAM,
        "description": "mcp-server-git on the drill's repository",
        "command": command,
        "env": dict(IDENTITY),
        "trust_annotations": True,
        "defaults": {"approval": "never"},
        "timeout": 30,
        # Two workers' servers on one repository can collide on git's lock files, and a
        # hook's failure is reported after the commit: an error it cannot read is unknown.
        "tools": {"git_commit": {"on_error": "unknown"}},
    }


def commit_input(repository: Path, number: int, run_name: str) -> dict[str, Any]:
    return {"repo_path": str(repository), "message": f"{run_name}: commit {number}"}


def commits_by_message(repository: Path) -> Counter[str]:
    out = subprocess.run(  # noqa: S603 - our own arguments
        [GIT, "-C", str(repository), "log", "--format=%s"],
        capture_output=True,
        text=True,
        check=True,
    )
    return Counter(out.stdout.splitlines())
