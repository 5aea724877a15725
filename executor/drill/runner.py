"""The recovery drill (DESIGN.md §5, §13), recorded as a DrillReport.

It starts its own ticket desk, sweeper and worker processes, posts steps while workers
crash at the interruption points, are SIGKILLed and restarted and the desk fails, waits
until every step has settled, and then checks each invariant of §13 against the desk's
tickets and the ledger. Every violation is named in the report's notes.
"""

from __future__ import annotations

import os
import random
import re
import secrets
import shutil
import sys
import tempfile
import time
import traceback
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from django.conf import settings
from django.db import connection
from django.utils import timezone

from executor.common import dispatch, faults
from executor.contract.tool import find_tool
from executor.drill import tools as file_tools
from executor.drill import upstream as drill_upstream
from executor.drill.clients import DeskClient, Publisher
from executor.drill.config import (
    DESK_FAULT_SETTINGS,
    EMBEDDED_BROKER,
    TOOLS,
    DrillConfig,
    DrillError,
    current_database_url,
    embedded_here,
    publishing_broker,
    redact_url,
)
from executor.drill.invariants import WRITES, Verdict, check_invariants, is_settled
from executor.drill.processes import (
    KILLED,
    TICK_SECONDS,
    Child,
    DeskProcess,
    GaveUp,
    Worker,
    command,
    in_call_to,
    tail,
)
from executor.drill.report import Progress, report_notes, tested_version
from executor.ledger.records import Agent, Attempt, DrillReport, Run, RunStatus, Step
from executor.ledger.states import LEASED, State
from executor.services.accounts import (
    agent_create,
    agent_set_tools,
    reviewer_create,
    workspace_get_or_create,
)
from executor.services.base import Conflict
from executor.services.posting import step_post
from executor.services.reviews import compensation_request, step_approve
from executor.services.runs import run_cancel, run_create
from executor.services.tools import tools_load

# The module that starts a child with a deliberately broken engine (--break).
BROKEN_ENGINE = "executor.drill.broken"
LOOK_SECONDS = 0.5
# A worker that keeps exiting for another reason than a fault point or our kill is broken
# (bad settings, unreachable database): the drill stops rather than restart it forever.
MAX_UNEXPECTED_EXITS = 5
FREEZE_PATIENCE_SECONDS = 3.0


@dataclass
class Snapshot:
    states: Counter[str]
    settled: int
    total: int
    completed_ids: set[uuid.UUID]

    @property
    def quiet(self) -> bool:
        return self.settled == self.total


class Drill:
    """One drill. `run()` carries it out and returns its saved DrillReport."""

    def __init__(
        self,
        config: DrillConfig,
        *,
        write: Callable[[str], object] = sys.stdout.write,
        interactive: bool = False,
    ) -> None:
        config.validate()
        self.config = config
        # Read and checked before anything is written or started.
        self.tools_file = (
            file_tools.read_tools_file(config.tools_file, config.tools)
            if config.tools_file
            else None
        )
        # The tools the drill posts its steps to.
        self.tools = [*TOOLS, *(self.tools_file.chosen if self.tools_file else [])]
        # `--upstream git`: mcp-server-git behind the gateway, on a repository of its own.
        self.upstream_command = drill_upstream.server_command() if config.upstream == "git" else ""
        self.repository: Path | None = None
        if self.upstream_command:
            self.tools.append(drill_upstream.TOOL)
        self.progress = Progress(write, interactive=interactive)
        self.rng = random.Random(config.seed)
        self.database_url = config.database_url or current_database_url()
        # Logs, the desk's file and the embedded broker; removed when the drill passes.
        self.tmp = Path(tempfile.mkdtemp(prefix="stepward-drill-"))
        self.queue = settings.CELERY_TASK_DEFAULT_QUEUE
        self.broker_dir: Path | None = None
        # What the workers are told, in the environment's terms (API.md: unset or
        # "filesystem://" means the embedded broker).
        self.broker_url = (
            config.broker_url or os.environ.get("CELERY_BROKER_URL", "") or EMBEDDED_BROKER
        )
        if self.broker_url == EMBEDDED_BROKER or (
            embedded_here() and self.broker_url == settings.CELERY_BROKER_URL
        ):
            # A fresh folder: no worker of anything else can take the drill's messages.
            self.broker_url = EMBEDDED_BROKER
            self.broker_dir = self.tmp / "broker"
        # Children start through the broken engine (--break), or as they are.
        self.through = BROKEN_ENGINE if config.break_engine else ""
        self.desk_process: DeskProcess | None = None
        self.desk: DeskClient | None = None
        self.sweeper: Child | None = None
        self.workers: list[Worker] = []
        self.publisher: Publisher | None = None
        self.kills = 0
        self.freezes = 0
        self.unexpected_exits: list[str] = []
        self.next_kill = float("inf")
        self.next_freeze = float("inf")
        self.posted: list[uuid.UUID] = []
        self.step_tools: dict[uuid.UUID, str] = {}
        # How many more completed steps of each tool a drill reviewer undoes, and how many
        # it did (`--compensate` of each tool's steps, at least one when it is not 0).
        self.compensation_quota: Counter[str] = Counter()
        self.compensated: Counter[str] = Counter()
        self.compensation_requested: set[uuid.UUID] = set()
        self.run_record: Run | None = None
        self.agent: Agent | None = None
        self.reviewer: Any = None
        self.approver: Any = None
        self.started = 0.0

    # --- the whole drill ----------------------------------------------------------------

    def run(self) -> DrillReport:
        try:
            if Step._meta.db_table not in connection.introspection.table_names():
                raise DrillError("the database has no ledger tables: run `manage.py migrate`")
            live = (
                Run.objects.exclude(workspace__slug="drill")
                .filter(status__in=(RunStatus.OPEN, RunStatus.PAUSED))
                .count()
            )
            if live:
                # The drill's workers and sweeper act on every due step in the database:
                # real work would go to the drill's desk and be crashed on purpose.
                raise DrillError(
                    f"this database holds {live} open run(s) outside the drill workspace; "
                    "run drills on a database of their own (--database URL)"
                )
            if self.tools_file is not None:
                file_tools.check_loadable(self.tools_file)
            self.started = time.monotonic()
            report = DrillReport.objects.create(
                version=tested_version(),
                started_at=timezone.now(),
                parameters=self.parameters(),
                interruption_points=self.interruption_points(),
            )
        except BaseException:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise
        notes: list[str] = []
        verdict = Verdict()
        quiet = aborted = False
        desk_stats: dict[str, Any] | None = None
        try:
            notes.extend(self.prepare(report))
            self.start_processes()
            self.post_steps()
            quiet = self.wait_quiet()
            self.stop_workers()
            assert self.desk is not None
            assert self.run_record is not None
            verdict = check_invariants(
                run=self.run_record,
                posted=self.posted,
                tickets=self.desk.tickets(),
                effects_elsewhere=self.upstream_effects(),
            )
            notes.extend(self.upstream_notes())
            if self.tools_file is not None and self.tools_file.secrets:
                leaks = file_tools.secret_leaks(self.run_record, self.tools_file.secrets)
                verdict.violations.extend(leaks)
                if not leaks:
                    names = ", ".join(f"${{{name}}}" for name in self.tools_file.secrets)
                    notes.append(
                        f"secrets: the workers read {names} (a throwaway value); it appears "
                        "nowhere in the ledger (inputs, results, attempts, events)"
                    )
            notes.extend(self.compensation_notes())
            desk_stats = self.desk.stats()
            if not quiet:
                notes.append(
                    f"not quiet after --timeout {self.config.timeout:g}s; "
                    "the unsettled steps are listed as lost"
                )
        except DrillError as error:
            aborted = True
            notes.append(f"the drill was aborted: {error}")
        except BaseException as error:
            aborted = True
            notes.append(f"the drill was aborted by {type(error).__name__}: {error}")
            notes.append(traceback.format_exc(limit=5))
            raise
        finally:
            self.stop_all()
            report.interruption_points = self.interruption_points(desk_stats)
            notes.extend(self.unexpected_exits)
            if self.publisher is not None and self.publisher.failed:
                notes.append(
                    f"{self.publisher.failed} messages could not be sent; the sweeper resends"
                )
            passed = verdict.passed and quiet and not aborted
            if not passed:
                notes.append(f"process logs kept in {self.tmp}")
            self.save(report, verdict, notes, passed=passed)
            if passed:
                shutil.rmtree(self.tmp, ignore_errors=True)
        return report

    def parameters(self) -> dict[str, Any]:
        config = self.config
        return {
            "steps": config.steps,
            "workers": config.workers,
            "tools": list(self.tools),
            **(
                {
                    "tools_file": str(self.tools_file.path),
                    "file_tools": list(self.tools_file.chosen),
                }
                if self.tools_file
                else {}
            ),
            "kill_every_seconds": config.kill_every,
            "freeze_every_seconds": config.freeze_every,
            "seed": config.seed,
            "timeout_seconds": config.timeout,
            "compensate": config.compensate,
            "database": f"{connection.vendor}: {redact_url(self.database_url)}",
            "broker": redact_url(self.broker_url)
            + (f" in {self.broker_dir}" if self.broker_dir else ""),
            "queue": self.queue,
            "lease_seconds": config.lease_seconds,
            "batch_size": config.batch_size,
            "sweep_seconds": config.sweep_seconds,
            "redispatch_after_seconds": config.redispatch_after,
            **({"break": config.break_engine} if config.break_engine else {}),
            **({"upstream": config.upstream} if config.upstream else {}),
        }

    def interruption_points(self, desk_stats: dict[str, Any] | None = None) -> dict[str, Any]:
        hits = self.fault_hits()
        points: dict[str, Any] = {
            "worker": {
                point: {"rate": self.config.worker_faults.get(point, 0.0), "hits": hits[point]}
                for point in faults.POINTS
            },
            "desk": {
                name: {"rate": self.config.desk_faults.get(name, 0.0)}
                for name in DESK_FAULT_SETTINGS
            },
            "desk_latency_ms": self.config.desk_faults.get("latency", 0.0),
            "kills": {"every_seconds": self.config.kill_every, "done": self.kills},
            "freezes": {
                "every_seconds": self.config.freeze_every,
                "seconds": self.freeze_seconds(),
                "done": self.freezes,
            },
            "worker_crashes": self.crashes(),
        }
        if desk_stats is not None:
            injected = desk_stats.get("faults_injected", {})
            points["desk"]["503"]["injected"] = injected.get("error_503", 0)
            points["desk"]["429"]["injected"] = injected.get("error_429", 0)
            points["desk"]["drop"]["injected"] = injected.get("drop_after_commit", 0)
            points["desk"]["stale_fence_refused"] = desk_stats.get("stale_fence_refused", 0)
        if self.run_record is not None:
            # Writes of woken-up workers that the ledger refused by fence (§7).
            points["fenced_out_attempts"] = Attempt.objects.filter(
                step__run=self.run_record, fenced_out_at__isnull=False
            ).count()
        return points

    def crashes(self) -> int:
        return sum(worker.crashes for worker in self.workers)

    def fault_hits(self) -> Counter[str]:
        hits: Counter[str] = Counter()
        for worker in self.workers:
            hits.update(re.findall(r"fault injected at (\w+)", worker.log()))
        return hits

    def save(
        self, report: DrillReport, verdict: Verdict, notes: list[str], *, passed: bool
    ) -> None:
        report.finished_at = timezone.now()
        report.counts = verdict.counts
        report.duplicates = verdict.duplicates
        report.lost = verdict.lost
        report.left_for_review = verdict.left_for_review
        report.elapsed_seconds = round(time.monotonic() - self.started, 3)
        report.passed = passed
        report.notes = report_notes(verdict, notes)
        if self.run_record is not None:
            report.parameters = {**report.parameters, "run_id": str(self.run_record.pk)}
        report.save()

    # --- setting up ---------------------------------------------------------------------

    def prepare(self, report: DrillReport) -> list[str]:
        """The drill's agent, reviewer and run; returns notes on what it found."""
        workspace = workspace_get_or_create(slug="drill", name="Recovery drills")
        notes = []
        # An earlier drill that timed out or was interrupted left work that this drill's
        # workers would otherwise carry to this drill's desk, as tickets of no step here.
        for leftover in Run.objects.filter(
            workspace=workspace, status__in=(RunStatus.OPEN, RunStatus.PAUSED)
        ):
            run_cancel(run=leftover, actor="drill", reason=f"recovery drill {report.pk} started")
            notes.append(f"cancelled {leftover.name}, left unfinished by an earlier drill")
        agent, _token = agent_create(
            workspace=workspace, name=f"drill-{report.pk}-{secrets.token_hex(3)}"
        )
        self.reviewer = reviewer_create(workspace=workspace, username="drill-reviewer")
        # Four eyes: who asks for a compensation may not approve it (step_approve).
        self.approver = reviewer_create(workspace=workspace, username="drill-approver")
        self.run_record, _ = run_create(
            agent=agent, name=f"recovery drill {report.pk}", key=f"drill-{report.pk}"
        )
        self.agent = agent
        return notes

    def child_env(self) -> dict[str, str]:
        env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": os.environ.get("DJANGO_SETTINGS_MODULE", "console.settings"),
            "DATABASE_URL": self.database_url,
            "CELERY_BROKER_URL": self.broker_url,
            "CELERY_QUEUE": self.queue,
            "EXECUTOR_ALLOW_FAULTS": "1",
            "EXECUTOR_FAULTS": "",
            "EXECUTOR_FAULTS_SEED": str(self.config.seed),
            "EXECUTOR_LEASE_SECONDS": str(self.config.lease_seconds),
            "EXECUTOR_BATCH_SIZE": str(self.config.batch_size),
            "EXECUTOR_SWEEP_SECONDS": str(self.config.sweep_seconds),
            "EXECUTOR_REDISPATCH_AFTER": str(self.config.redispatch_after),
            # The workers' events must verify under this process's key.
            "EXECUTOR_LEDGER_KEY": settings.EXECUTOR_LEDGER_KEY,
            "LOG_LEVEL": "INFO",
            "PYTHONUNBUFFERED": "1",
        }
        env.pop("EXECUTOR_BREAK", None)
        if self.config.break_engine:
            env["EXECUTOR_BREAK"] = self.config.break_engine
        if self.broker_dir is not None:
            env["STEPWARD_BROKER_DIR"] = str(self.broker_dir)
        if self.desk is not None:
            env["TICKETDESK_URL"] = self.desk.url
            # The HTTP tools of --tools-file are pointed at the desk: they may call it.
            env["EXECUTOR_HTTP_ALLOWED_HOSTS"] = ",".join(
                [*settings.EXECUTOR_HTTP_ALLOWED_HOSTS, urlsplit(self.desk.url).netloc]
            )
        if self.tools_file is not None:
            # Throwaway values, never the caller's own secrets.
            env.update(self.tools_file.secrets)
        return env

    def start_processes(self) -> None:
        self.start_desk()
        assert self.desk is not None
        rates = self.config.desk_faults
        self.desk.set_faults(
            error_503_rate=rates.get("503", 0.0),
            error_429_rate=rates.get("429", 0.0),
            drop_after_commit_rate=rates.get("drop", 0.0),
            latency_ms=rates.get("latency", 0.0),
            retry_after=self.config.retry_after,
            seed=self.config.seed,
        )
        self.publisher = Publisher(
            *publishing_broker(self.broker_url, self.broker_dir), queue=self.queue
        )
        if self.tools_file is not None:
            loaded = file_tools.load(self.tools_file, self.desk.url)
            assert self.agent is not None
            agent_set_tools(agent=self.agent, tools=None)
            changed = [*loaded.created, *loaded.updated]
            self.progress.line(
                f"drill: loaded the tools of {self.tools_file.path} at {self.desk.url}"
                + (f" ({', '.join(changed)} new or changed)" if changed else "")
            )
        if self.upstream_command:
            self.load_upstream()
        env = self.child_env()
        sweep = command("sweep", "--loop", through=self.through)
        self.sweeper = Child("sweeper", sweep, env, self.tmp / "sweeper.log")
        self.sweeper.start()
        worker_env = {**env, "EXECUTOR_FAULTS": self.config.worker_fault_spec()}
        for number in range(1, self.config.workers + 1):
            name = f"w{number}"
            worker = Worker(
                name,
                worker_env,
                self.tmp / f"{name}.log",
                queue=self.queue,
                node=f"drill-{name}@%h",
                through=self.through,
            )
            worker.start()
            self.workers.append(worker)
        self.next_kill = self.after(self.config.kill_every)
        self.next_freeze = self.after(self.config.freeze_every)

    def load_upstream(self) -> None:
        """The drill's repository and mcp-server-git on it, listed from here before any
        step is posted (the workers start their own sessions with it)."""
        assert self.agent is not None
        self.repository = drill_upstream.make_repository(self.tmp / "repository")
        table = drill_upstream.upstream_table(
            self.repository, [self.upstream_command, "--repository", str(self.repository)]
        )
        loaded = tools_load(tables=[], upstreams=[table])
        problems = [listed.error for listed in loaded.listed if listed.error]
        if problems or drill_upstream.TOOL not in loaded.listed[0].tools:
            raise DrillError(f"mcp-server-git could not be listed: {'; '.join(problems)}")
        agent_set_tools(agent=self.agent, tools=None)
        self.progress.line(
            f"drill: mcp-server-git behind the gateway on {self.repository} "
            f"({len(loaded.listed[0].tools)} tools)"
        )

    def upstream_effects(self) -> dict[uuid.UUID, int]:
        """How many commits the repository has with each upstream step's message."""
        if self.repository is None:
            return {}
        commits = drill_upstream.commits_by_message(self.repository)
        return {
            step.pk: commits[str(step.input.get("message", ""))]
            for step in Step.objects.filter(pk__in=self.posted, tool_id=drill_upstream.TOOL)
        }

    def upstream_notes(self) -> list[str]:
        if self.repository is None:
            return []
        effects = self.upstream_effects()
        states = Counter(Step.objects.filter(pk__in=effects).values_list("state", flat=True))
        waiting = states.get(State.UNKNOWN, 0)
        by_state = ", ".join(f"{state}={n}" for state, n in sorted(states.items()))
        twice = sum(1 for count in effects.values() if count > 1)
        return [
            f"upstream git: {len(effects)} git_commit step(s) ({by_state}); "
            f"{sum(effects.values())} commit(s) in the repository, {twice} step(s) with more "
            f"than one; {waiting} whose answer was lost wait for a reviewer"
        ]

    def start_desk(self) -> None:
        # The desk is the external system: it is never broken, whatever the engine is.
        self.desk_process = DeskProcess(self.tmp, self.child_env())
        try:
            self.desk_process.start()
        except GaveUp as error:
            raise DrillError(f"the ticket desk did not start:\n{error}") from None
        self.desk = DeskClient(self.desk_process.url)

    # --- posting ------------------------------------------------------------------------

    def post_steps(self) -> None:
        assert self.run_record is not None
        assert self.publisher is not None
        assert self.agent is not None
        plan = [self.tools[number % len(self.tools)] for number in range(self.config.steps)]
        self.rng.shuffle(plan)
        if self.config.compensate:
            for name, count in Counter(plan).items():
                found = find_tool(name)
                if found is not None and found.compensation:
                    self.compensation_quota[name] = max(1, round(self.config.compensate * count))
        self.progress.line(
            f"drill: posting {len(plan)} steps for {self.config.workers} workers "
            f"(seed {self.config.seed}, logs in {self.tmp})"
        )
        for number, tool in enumerate(plan):
            tool_input: dict[str, Any] = (
                {"drill": self.run_record.name, "number": number}
                if tool == "echo"
                else {"title": f"drill ticket {number}", "body": self.run_record.name}
            )  # the shape of file_tools.DRILL_INPUT
            if tool == drill_upstream.TOOL:
                assert self.repository is not None
                tool_input = drill_upstream.commit_input(
                    self.repository, number, self.run_record.name
                )
            # This process's own Celery settings may point elsewhere: the step is announced
            # on the drill's broker below, explicitly.
            with dispatch.publishing(dispatch.dropping_publisher):
                step, _ = step_post(
                    agent=self.agent,
                    run=self.run_record,
                    key=f"drill-{number:05d}",
                    tool_name=tool,
                    input=tool_input,
                )
            self.posted.append(step.pk)
            self.step_tools[step.pk] = tool
            if step.state == State.PENDING:
                self.publisher.send(step.pk)
            self.tick()

    # --- chaos --------------------------------------------------------------------------

    def after(self, every: float) -> float:
        """When the next random event of a series with this mean interval is due."""
        return time.monotonic() + self.rng.uniform(0.5, 1.5) * every if every else float("inf")

    def freeze_seconds(self) -> float:
        # Long enough for the lease to expire and the sweeper to take the step over.
        return 2 * self.config.lease_seconds + 2 * self.config.sweep_seconds

    def tick(self) -> None:
        """Restarts what ended, thaws what was frozen long enough, and kills or freezes a
        worker when one is due."""
        assert self.desk_process is not None
        assert self.sweeper is not None
        if not self.desk_process.alive:
            raise DrillError(f"the ticket desk exited:\n{tail(self.desk_process.log())}")
        now = time.monotonic()
        for child in [self.sweeper, *self.workers]:
            if child.frozen_until is not None and now >= child.frozen_until:
                child.thaw()
            killed = child.killed_on_purpose
            code = child.reap()
            if code is None:
                continue
            if code != faults.CRASH_EXIT_STATUS and not (killed and code == KILLED):
                self.unexpected_exits.append(
                    f"{child.name} exited with status {code}:\n{tail(child.log(), 15)}"
                )
                if len(self.unexpected_exits) > MAX_UNEXPECTED_EXITS:
                    raise DrillError(
                        f"processes keep exiting unexpectedly; last: {child.name}, status "
                        f"{code}:\n{tail(child.log())}"
                    )
            child.start()
        if now >= self.next_kill:
            # A frozen worker is left to wake up: that is what its freeze is for. One still
            # starting is left to start: on a loaded machine a worker's start can take
            # longer than `kill_every`, and killing it then would test nothing, forever.
            alive = [w for w in self.workers if w.ready and w.frozen_until is None]
            if alive:
                self.rng.choice(alive).kill()
                self.kills += 1
            self.next_kill = self.after(self.config.kill_every)
        if now >= self.next_freeze:
            # Never every worker at once: another one must be awake to take over.
            awake = [w for w in self.workers if w.alive and w.frozen_until is None]
            if not (len(awake) > 1 or (awake and len(self.workers) == 1)):
                self.next_freeze = self.after(self.config.freeze_every)
                return
            # A worker frozen between two steps tests nothing: wait a little for one that
            # holds a lease and is inside its desk call, so that it wakes up with a response
            # to a step that was taken over meanwhile.
            holding = self.lease_holders(awake)
            calling = [w for w in holding if in_call_to(w.pid, self.desk_process.port)]
            patience_over = now >= self.next_freeze + FREEZE_PATIENCE_SECONDS
            if calling or (patience_over and (holding or awake)):
                self.rng.choice(calling or holding or awake).freeze(self.freeze_seconds())
                self.freezes += 1
                self.next_freeze = self.after(self.config.freeze_every)

    def lease_holders(self, workers: list[Worker]) -> list[Worker]:
        owners = set(
            Step.objects.filter(run=self.run_record, state__in=LEASED).values_list(
                "lease_owner", flat=True
            )
        )
        return [w for w in workers if w.worker_name in owners]

    # --- waiting until quiet ------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        states: Counter[str] = Counter()
        settled = 0
        completed: set[uuid.UUID] = set()
        rows = Step.objects.filter(run=self.run_record).values_list("pk", "state", "not_before")
        for pk, state, not_before in rows:
            states[state] += 1
            settled += is_settled(state, not_before)
            if state == State.COMPLETED:
                completed.add(pk)
        return Snapshot(
            states=states, settled=settled, total=sum(states.values()), completed_ids=completed
        )

    def request_compensations(self, snapshot: Snapshot) -> int:
        """A drill reviewer undoes completed steps of each tool that names a compensation,
        up to its quota: requested by one reviewer and approved by another, so that
        `ticketdesk.close` (or a file's close tool) runs through the same machinery.
        Returns how many it asked for (or found moved meanwhile)."""
        assert self.publisher is not None
        due = [
            pk
            for pk in self.posted
            if pk in snapshot.completed_ids
            and pk not in self.compensation_requested
            and self.compensation_quota[self.step_tools[pk]] > 0
        ]
        asked = 0
        for step in Step.objects.filter(pk__in=due).order_by("position"):
            if self.compensation_quota[step.tool_id] <= 0:
                continue
            asked += 1
            try:
                with dispatch.publishing(dispatch.dropping_publisher):
                    compensation = compensation_request(
                        step=step,
                        user=self.reviewer,
                        version=step.version,
                        reason="recovery drill: undo this ticket",
                    )
                    step_approve(
                        step=compensation,
                        user=self.approver,
                        version=compensation.version,
                        reason="recovery drill: approved compensation",
                    )
            except Conflict:
                continue  # it moved meanwhile; looked at again next time
            # Any other refusal (permission, input) is the drill's own mistake: it aborts
            # the drill, named in its notes, rather than leaving a step that never settles.
            self.compensation_requested.add(step.pk)
            self.compensation_quota[step.tool_id] -= 1
            self.compensated[step.tool_id] += 1
            compensation.refresh_from_db(fields=["state"])
            if compensation.state == State.PENDING:
                self.publisher.send(compensation.pk)
        return asked

    def compensation_notes(self) -> list[str]:
        """Which compensation tools the drill exercised, and which it did not, and why."""
        notes = []
        for name in dict.fromkeys(self.tools):
            tool = find_tool(name)
            if tool is None or tool.effect not in WRITES or not tool.compensation:
                continue
            done = self.compensated[name]
            if done:
                notes.append(
                    f"compensation: {done} completed step(s) of {name} undone with "
                    f"{tool.compensation} (asked by drill-reviewer, approved by drill-approver)"
                )
            else:
                why = "--compensate is 0" if not self.config.compensate else "no step completed"
                notes.append(
                    f"compensation: {tool.compensation}, which undoes {name}, was not "
                    f"exercised: {why}"
                )
        return notes

    def wait_quiet(self) -> bool:
        """Drives the chaos until every step has settled; False at the deadline."""
        deadline = time.monotonic() + self.config.timeout
        next_look = 0.0
        while True:
            self.tick()
            now = time.monotonic()
            if now >= next_look:
                snapshot = self.snapshot()
                waiting = self.request_compensations(snapshot)
                quiet = snapshot.quiet and not waiting
                self.progress.update(
                    snapshot.settled, snapshot.total, self.describe(snapshot), force=quiet
                )
                if quiet:
                    self.progress.end_bar()
                    return True
                if now > deadline:
                    self.progress.end_bar()
                    return False
                next_look = now + LOOK_SECONDS
            time.sleep(TICK_SECONDS)

    def describe(self, snapshot: Snapshot) -> str:
        states = " ".join(f"{state}={n}" for state, n in sorted(snapshot.states.items()))
        return (
            f"{states}; crashes={self.crashes()} kills={self.kills} freezes={self.freezes} "
            f"{time.monotonic() - self.started:.0f}s"
        )

    # --- stopping -----------------------------------------------------------------------

    def stop_workers(self) -> None:
        for child in [*self.workers, self.sweeper]:
            if child is not None:
                child.stop()

    def stop_all(self) -> None:
        self.stop_workers()
        if self.desk is not None:
            self.desk.close()
        if self.desk_process is not None:
            self.desk_process.stop()
        if self.publisher is not None:
            self.publisher.close()
