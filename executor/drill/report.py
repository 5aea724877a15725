"""What the drill reports: the version it tested, its progress while it runs, the notes of
its DrillReport and the summary printed from that report."""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
import time
import tomllib
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from django.conf import settings

from executor.common import faults
from executor.drill.config import DESK_FAULT_SETTINGS
from executor.drill.invariants import Verdict
from executor.ledger.records import DrillReport

PLAIN_PROGRESS_SECONDS = 10.0


def tested_version() -> str:
    """The package version, plus the git commit (and "-dirty") when there is a checkout."""
    try:
        version = importlib.metadata.version("stepward")
    except importlib.metadata.PackageNotFoundError:
        try:
            with (Path(settings.BASE_DIR) / "pyproject.toml").open("rb") as file:
                version = str(tomllib.load(file)["project"]["version"])
        except (OSError, KeyError, tomllib.TOMLDecodeError):
            version = "unknown"
    git = shutil.which("git")
    if git is None:
        return version
    try:
        commit = subprocess.run(  # noqa: S603 - git, fixed arguments
            [git, "rev-parse", "--short", "HEAD"],
            cwd=settings.BASE_DIR,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        # --no-optional-locks: reading the state must not rewrite the index.
        changes = subprocess.run(  # noqa: S603 - git, fixed arguments
            [git, "--no-optional-locks", "status", "--porcelain"],
            cwd=settings.BASE_DIR,
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return version
    return f"{version} ({commit}{'-dirty' if changes else ''})"


class Progress:
    """A progress bar on a terminal, a plain line every few seconds otherwise."""

    def __init__(self, write: Callable[[str], object], *, interactive: bool) -> None:
        self.write = write
        self.interactive = interactive
        self.bar_shown = False
        self.next_plain = 0.0

    def line(self, text: str) -> None:
        self.end_bar()
        self.write(text + "\n")

    def update(self, settled: int, total: int, detail: str, *, force: bool = False) -> None:
        if self.interactive:
            width = 30
            done = width * settled // max(total, 1)
            bar = "#" * done + "." * (width - done)
            self.write(f"\r[{bar}] {settled}/{total} settled  {detail}\x1b[K")
            self.bar_shown = True
            return
        now = time.monotonic()
        if force or now >= self.next_plain:
            self.write(f"drill: {settled}/{total} settled; {detail}\n")
            self.next_plain = now + PLAIN_PROGRESS_SECONDS

    def end_bar(self) -> None:
        if self.bar_shown:
            self.write("\n")
            self.bar_shown = False


def summary_lines(report: DrillReport) -> list[str]:
    points = report.interruption_points
    worker = points.get("worker", {})
    desk = points.get("desk", {})
    hits = " ".join(f"{point}={worker.get(point, {}).get('hits', 0)}" for point in faults.POINTS)
    injected = " ".join(
        f"{name}={desk.get(name, {}).get('injected', 0)}" for name in DESK_FAULT_SETTINGS
    )
    states = " ".join(f"{state}={n}" for state, n in sorted(report.counts.items()))
    total = sum(report.counts.values())
    lines = [
        f"drill {report.pk} of {report.version}: {total} steps in "
        f"{report.elapsed_seconds:.0f}s on {report.parameters.get('database', '?')}, "
        f"broker {report.parameters.get('broker', '?')}",
        f"  tools: {', '.join(report.parameters.get('tools', [])) or '?'}"
        + (
            f" (from {report.parameters['tools_file']}: "
            f"{', '.join(report.parameters.get('file_tools', []))})"
            if report.parameters.get("tools_file")
            else ""
        ),
        f"  states: {states or '(none)'}",
        f"  worker crashes at fault points: {hits} "
        f"(total {points.get('worker_crashes', 0)}); "
        f"SIGKILLs: {points.get('kills', {}).get('done', 0)}; "
        f"freezes past the lease: {points.get('freezes', {}).get('done', 0)}",
        f"  desk faults injected: {injected}; stale fences refused by the desk: "
        f"{desk.get('stale_fence_refused', 0)}, by the ledger: "
        f"{points.get('fenced_out_attempts', 0)}",
        f"  duplicates {report.duplicates}, lost {report.lost}, "
        f"left for review {report.left_for_review}",
        f"  verdict: {'PASSED' if report.passed else 'FAILED'}",
    ]
    if not report.passed:
        lines.extend("  " + line for line in report.notes.splitlines()[:40])
    return lines


def report_notes(verdict: Verdict, notes: list[str]) -> str:
    """The report's notes: every violation, every step left for review, then `notes`."""
    lines = []
    if verdict.violations:
        lines.append(f"{len(verdict.violations)} violation(s):")
        lines.extend(f"- {violation}" for violation in verdict.violations)
    else:
        lines.append("no violation found")
    if verdict.waiting:
        lines.append(f"{len(verdict.waiting)} step(s) left for review:")
        lines.extend(f"- {waiting}" for waiting in verdict.waiting)
    lines.extend(notes)
    return "\n".join(lines)


# --- a report recorded in another database (`drill --report-to`) -------------------------

RECORDED_FIELDS = (
    "version",
    "parameters",
    "interruption_points",
    "counts",
    "duplicates",
    "lost",
    "left_for_review",
    "elapsed_seconds",
    "passed",
    "notes",
)


def as_record(report: DrillReport) -> dict[str, Any]:
    """The report as JSON, for `manage.py record_drill` in the database it goes to."""
    data = {name: getattr(report, name) for name in RECORDED_FIELDS}
    data["started_at"] = report.started_at.isoformat()
    data["finished_at"] = report.finished_at.isoformat() if report.finished_at else None
    data["drilled_as"] = report.pk
    return data


def record(data: dict[str, Any]) -> DrillReport:
    """A copy of a drill's report in this process's database. The drill's own number and
    database go into its parameters, so the copy says where the drill's ledger is."""
    missing = [name for name in (*RECORDED_FIELDS, "started_at") if name not in data]
    if missing:
        raise ValueError(f"not a drill report: {', '.join(missing)} missing")
    fields = {name: data[name] for name in RECORDED_FIELDS}
    fields["parameters"] = {**fields["parameters"], "drilled_as": data.get("drilled_as")}
    finished = data.get("finished_at")
    return DrillReport.objects.create(
        **fields,
        started_at=datetime.fromisoformat(data["started_at"]),
        finished_at=datetime.fromisoformat(finished) if finished else None,
    )
