"""The worker runtime: a message wakes a drain, which claims and runs due steps in batches
until nothing is due (or its limit), keeping calls in flight and committing in groups."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings

from executor.contract.tool import Tool
from executor.engine.claiming import claim, claim_step
from executor.engine.commits import execute_claimed, run_light
from executor.engine.common import Claim, Outcome, is_light, worker_name
from executor.engine.inflight import InFlight
from executor.engine.leases import LeaseKeeper
from executor.ledger import transitions
from executor.ledger.records import Effect, RunStatus, Step
from executor.ledger.states import State


def process(step_id: Any, *, worker: str | None = None) -> str:
    """Advances one step as far as it goes. Returns the state it ended in, or an Outcome."""
    worker = worker or worker_name()
    claimed = claim_step(step_id, worker=worker)
    if not isinstance(claimed, Claim):
        return claimed
    with LeaseKeeper([claimed]):
        if is_light(claimed.tool):
            return run_light([claimed])[claimed.step.pk]
        return execute_claimed(claimed)


def cancel_if_run_cancelled(step_id: Any, *, actor: str) -> str:
    """A pending step of a cancelled run is cancelled (the sweeper's backstop)."""
    step = Step.objects.select_related("run").filter(pk=step_id).first()
    if step is None or step.state != State.PENDING or step.run.status != RunStatus.CANCELLED:
        return Outcome.SKIPPED
    try:
        transitions.move(step, State.CANCELLED, actor=actor, reason="the run was cancelled")
    except transitions.TransitionError:
        return Outcome.SKIPPED
    return State.CANCELLED


def drain(*, worker: str, limit: int | None = None) -> int:
    """Claims and runs due steps in batches until nothing is due (or `limit` were claimed).

    Returns how many it claimed. Pure and read steps run here, batch by batch; write steps
    go to the pool, and a batch claims no more of them than the pool has room for.
    """
    return _drain(worker=worker, limit=limit).claimed


def wake(step_id: Any, *, worker: str, limit: int | None = None) -> str:
    """What a message does: looks at the named step in the first batch, then drains due
    work until none is left (or `limit` more steps were claimed). Returns what happened to
    the named step: the state it ended in, or an Outcome."""
    try:
        hint = uuid.UUID(str(step_id))
    except ValueError:  # not a step id at all: nothing to look at but the due work
        _drain(worker=worker, limit=limit)
        return Outcome.SKIPPED
    return _drain(worker=worker, limit=limit, hint=hint).ends.get(hint, Outcome.SKIPPED)


@dataclass
class Drained:
    claimed: int = 0
    # Where each step looked at ended (a state, or an Outcome).
    ends: dict[Any, str] = field(default_factory=dict)


def _drain(*, worker: str, limit: int | None, hint: Any = None) -> Drained:
    limit = settings.EXECUTOR_DRAIN_LIMIT if limit is None else limit
    size = settings.EXECUTOR_BATCH_SIZE
    drained = Drained()
    named = [hint] if hint is not None else []
    held = HeldBack()
    with LeaseKeeper() as keeper:
        flight = InFlight(settings.EXECUTOR_MAX_IN_FLIGHT, keeper, drained.ends, ahead=size)
        try:
            while named or drained.claimed < limit:
                room = min(size, limit - drained.claimed)
                writes = flight.room(room)
                skipped = held.skipped()
                batch = claim(
                    worker=worker,
                    step_ids=named,
                    light=room,
                    writes=writes,
                    skip_tools=skipped,
                    limited=flight.free(),
                )
                held.found_full(batch.full)
                held_back = bool(batch.full or skipped)
                named = []
                drained.ends.update(batch.outcomes)
                if batch.claims:
                    held.reset()
                    drained.claimed += len(batch.claims)
                    keeper.hold(batch.claims)
                    # Pure steps wait on nothing: they run here, at once. With no calls in
                    # flight (limit 0), reads do too.
                    here = [c for c in batch.claims if _called_here(c.tool, flight)]
                    flight.add([c for c in batch.claims if not _called_here(c.tool, flight)])
                    if here:
                        drained.ends.update(run_light(here))
                        keeper.release(here)
                    flight.collect()
                elif batch.outcomes and drained.claimed < limit:
                    continue  # only refusals: look again
                elif flight.busy():
                    # Nothing due that there is room for: commit answers as they come, and
                    # look for new work at least every LOOK_SECONDS (more often while a
                    # tool's limit holds steps back: its room comes back with time too).
                    flight.collect(wait_seconds=HELD_SECONDS if held_back else LOOK_SECONDS)
                elif writes == 0 < room:
                    continue  # no room when this claim looked: look for writes now
                elif held_back and held.wait():
                    continue  # only steps a tool's limit holds back: look again soon
                else:
                    break
        finally:
            flight.join()
    return drained


# How long a drain with calls in flight and nothing due waits for an answer before it looks
# for new work again; and as often while a tool's limit holds steps back.
LOOK_SECONDS = 0.5
HELD_SECONDS = 0.05


class HeldBack:
    """What a drain knows of the tools at their limit (API.md "Slow tools").

    A tool found without room is skipped by the drain's claims for SKIP_SECONDS, so that its
    due steps, oldest first, do not fill every batch and hide other tools' steps; then it is
    looked at again. A drain with nothing to do but such steps looks again after a wait that
    doubles (from HELD_SECONDS to 1 s), for at most HOLD_SECONDS in all; then it ends, and
    the sweeper's redispatch of due steps (EXECUTOR_REDISPATCH_AFTER) wakes a worker for
    them later: a tool limited to a few calls an hour holds no worker.
    """

    HOLD_SECONDS = 5.0
    SKIP_SECONDS = 0.2

    def __init__(self) -> None:
        self.reset()
        self._full: dict[str, float] = {}

    def found_full(self, tools: set[str]) -> None:
        until = time.monotonic() + self.SKIP_SECONDS
        self._full.update((tool, until) for tool in tools)

    def skipped(self) -> list[str]:
        now = time.monotonic()
        self._full = {tool: until for tool, until in self._full.items() if until > now}
        return sorted(self._full)

    def reset(self) -> None:
        self.pause = HELD_SECONDS
        self.since: float | None = None

    def wait(self) -> bool:
        """Waits before the next look; False (no wait) once HOLD_SECONDS have passed."""
        now = time.monotonic()
        self.since = self.since if self.since is not None else now
        if now - self.since >= self.HOLD_SECONDS:
            return False
        time.sleep(self.pause)
        self.pause = min(1.0, self.pause * 2)
        return True


def _called_here(tool: Tool, flight: InFlight) -> bool:
    return tool.effect == Effect.PURE or (is_light(tool) and flight.limit == 0)
