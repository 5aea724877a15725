"""The soak: 300 steps over the desk tools while workers crash at every interruption point,
are SIGKILLed at random moments and restarted, and the desk answers 503, 429 and drops
connections after committing. Afterwards: no duplicate, nothing lost, every completed
ticket step names the desk's one ticket (DESIGN.md §13)."""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from executor.common import faults
from executor.drill.invariants import FINAL_STATES
from executor.ledger.chain import verify_chain
from executor.ledger.records import OPEN_PHASES, Phase, Step
from executor.ledger.states import State
from tests.support.cluster import Cluster, is_settled
from tests.support.processes import POLL_SECONDS, Worker

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

SEED = 20261130
STEPS_PER_TOOL = 100
TOOLS = ("ticketdesk.create", "ticketdesk.create_keyed", "echo")
DESK_TOOLS = frozenset(TOOLS[:2])
WORKER_FAULTS = "before_invoke:0.05,after_submit:0.05,before_persist:0.05"
DESK_FAULTS = {
    "error_503_rate": 0.03,
    "error_429_rate": 0.03,
    "retry_after": 1,
    "drop_after_commit_rate": 0.03,
    "seed": SEED,
}
# Seconds between two random SIGKILLs.
KILL_INTERVAL = (2.0, 6.0)
QUIET_DEADLINE_SECONDS = 420.0
# A crash strands its worker's whole claimed batch until the lease expires: at these crash
# rates, batches of 100 left the soak waiting on leases (as the drill's --batch-size says).
BATCH = {"EXECUTOR_BATCH_SIZE": "10"}


def step_input(tool: str, number: int) -> dict[str, Any]:
    if tool == "echo":
        return {"number": number}
    return {"title": f"soak ticket {number}"}


class Chaos:
    """Keeps two workers alive through their own crashes and kills one now and then."""

    def __init__(self, workers: list[Worker], rng: random.Random) -> None:
        self.workers = workers
        self.rng = rng
        self.kills = 0
        self.next_kill = time.monotonic() + rng.uniform(*KILL_INTERVAL)

    def tick(self) -> None:
        for worker in self.workers:
            if not worker.alive:
                worker.start(
                    faults=WORKER_FAULTS, wait=False, EXECUTOR_FAULTS_SEED=str(SEED), **BATCH
                )
        if time.monotonic() >= self.next_kill:
            victim = self.rng.choice(self.workers)
            if victim.alive:
                victim.kill()
                self.kills += 1
            self.next_kill = time.monotonic() + self.rng.uniform(*KILL_INTERVAL)

    def deaths(self) -> Counter[int]:
        return Counter(code for worker in self.workers for code in worker.exit_codes)


def test_soak_under_crashes_kills_and_desk_faults_loses_and_duplicates_nothing(
    cluster: Cluster, post: Callable[..., Step], capsys: pytest.CaptureFixture[str]
) -> None:
    rng = random.Random(SEED)
    started = time.monotonic()
    cluster.desk.faults(**DESK_FAULTS)
    cluster.sweeper().start()
    workers = [
        cluster.worker(name).start(faults=WORKER_FAULTS, EXECUTOR_FAULTS_SEED=str(SEED), **BATCH)
        for name in ("w1", "w2")
    ]
    chaos = Chaos(workers, rng)

    plan = [tool for tool in TOOLS for _ in range(STEPS_PER_TOOL)]
    rng.shuffle(plan)
    posted: dict[Any, tuple[str, dict[str, Any]]] = {}
    for number, tool in enumerate(plan):
        tool_input = step_input(tool, number)
        step = post(tool, tool_input, key=f"soak-{number:03d}")
        posted[step.pk] = (tool, tool_input)
        chaos.tick()

    def unsettled() -> int:
        waiting = Step.objects.filter(pk__in=list(posted)).exclude(state__in=FINAL_STATES)
        return waiting.exclude(state=State.UNKNOWN, not_before__isnull=True).count()

    deadline = time.monotonic() + QUIET_DEADLINE_SECONDS
    while unsettled():
        if time.monotonic() > deadline:
            pytest.fail(f"not quiet after {QUIET_DEADLINE_SECONDS:g}s\n{cluster.diagnose()}")
        chaos.tick()
        time.sleep(POLL_SECONDS * 5)
    elapsed = time.monotonic() - started
    cluster.stop_all()

    steps = {step.pk: step for step in Step.objects.filter(pk__in=list(posted))}
    desk_stats = cluster.desk.stats()
    tickets = cluster.desk.tickets_by_ref()
    states = Counter(step.state for step in steps.values())
    summary = (
        f"\nsoak: {len(steps)} steps in {elapsed:.0f}s: {dict(sorted(states.items()))}; "
        f"worker deaths by exit status {dict(chaos.deaths())} ({chaos.kills} random kills); "
        f"desk faults {desk_stats['faults_injected']}, "
        f"stale fences refused {desk_stats['stale_fence_refused']}"
    )
    with capsys.disabled():
        print(summary)

    # Nothing lost: every posted step is there and settled.
    assert set(steps) == set(posted)
    assert all(is_settled(step) for step in steps.values()), summary
    # No duplicate: no operation has two tickets at the desk.
    operations = {str(step.operation_id) for step in steps.values()}
    duplicates = {ref: ids for ref, ids in tickets.items() if ref in operations and len(ids) > 1}
    assert duplicates == {}, summary
    problems = []
    for step in steps.values():
        tool, tool_input = posted[step.pk]
        ref = str(step.operation_id)
        phases = [attempt.phase for attempt in step.attempts.all()]
        found = tickets.get(ref)
        if (
            step.state == State.COMPLETED
            and tool in DESK_TOOLS
            and found != [int(step.external_id)]
        ):
            problems.append(f"{step.key}: external_id {step.external_id}, desk has {found}")
        if step.state == State.COMPLETED and tool == "echo" and step.result != tool_input:
            problems.append(f"{step.key}: echo returned {step.result}")
        if step.state == State.UNKNOWN and not step.failure_message:
            problems.append(f"{step.key}: unknown without a reason")
        if phases.count(Phase.RESPONDED) > 1:
            problems.append(f"{step.key}: submitted again after a stored response: {phases}")
        if any(phase in OPEN_PHASES for phase in phases):
            problems.append(f"{step.key}: settled with an open attempt: {phases}")
    assert problems == [], summary
    # Every state change has its event, and the chains are intact.
    chain = verify_chain(step_ids=list(posted))
    assert chain.ok, [str(finding) for finding in chain.findings]
    # The crashes really happened: at the fault points and by SIGKILL.
    assert chaos.deaths()[faults.CRASH_EXIT_STATUS] > 0
    assert chaos.kills > 0
