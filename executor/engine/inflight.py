"""The calls a drain has in flight (DESIGN.md §16), and the process's event loop they wait on
(executor/engine/calls.py)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

from django.utils import timezone

import executor.engine.calls as calls
import executor.engine.commits as commits
from executor.common import logcontext
from executor.engine.commits import execute_claimed, submit_many, verify_many
from executor.engine.common import Claim, Outcome, call_of, is_light, log_fields
from executor.engine.leases import LeaseKeeper
from executor.ledger.states import State

logger = logging.getLogger(__name__)


class InFlight:
    """The calls a drain has in flight: up to `limit` at once, on the process's call loop
    (executor/engine/calls.py), none holding a database connection. Everything they need
    written this (the drain's) thread writes, in groups: the `submitting` marks of the writes about
    to start in one commit (`submit_many`), the answers that arrived by the time it looks in
    one commit (`store_answers`), the writes' completions in one more (`verify_many`); the
    lease keeper renews every lease in flight in one statement.

    Claims wait in `waiting` (claimed, nothing sent: a crash leaves them for recovery to
    retry, §7) until there is room; up to `ahead` more than there is room for are claimed,
    so that a call that answers is followed by the next at once, not after a claim. With
    `limit` 0 every call is made in this thread, one at a time, as it is claimed (in-process
    tests: their uncommitted rows are this thread's).
    """

    def __init__(
        self, limit: int, keeper: LeaseKeeper, ends: dict[Any, str], *, ahead: int = 0
    ) -> None:
        self.limit = limit
        self.ahead = ahead
        self.keeper = keeper
        # Where each step it ran ended, as its group is committed.
        self.ends = ends
        self._waiting: list[Claim] = []
        self._running: dict[Future[calls.Answer], Claim] = {}

    def room(self, wanted: int) -> int:
        """How many write steps to claim now."""
        if self.limit == 0:
            return wanted
        held = len(self._running) + len(self._waiting)
        return max(0, min(wanted, self.limit + self.ahead - held))

    def free(self) -> int | None:
        """How many calls could start now (None: no limit, every call is made as claimed).
        Steps of a tool with limits are claimed no further ahead than this: one waiting
        here would hold a room of the tool's that another worker could be sending in."""
        if self.limit == 0:
            return None
        return max(0, self.limit - len(self._running) - len(self._waiting))

    def add(self, claims: Sequence[Claim]) -> None:
        """Takes claimed steps whose call is not made in the claiming thread (writes, reads)."""
        if self.limit == 0:
            for c in claims:
                self.ends[c.step.pk] = execute_claimed(c)
                self.keeper.release([c])
            return
        self._waiting += claims
        self._start()

    def busy(self) -> bool:
        return bool(self._running or self._waiting)

    def collect(self, *, wait_seconds: float = 0) -> None:
        """Commits the answers that have arrived, waiting up to `wait_seconds` for the first
        one if none has. The calls that wait for room start first: an answer frees its room
        when it arrives, not when it is committed."""
        if self._running and wait_seconds > 0:
            wait(self._running, timeout=wait_seconds, return_when=FIRST_COMPLETED)
        arrived = [(self._running.pop(f), f.result()) for f in list(self._running) if f.done()]
        self._start()
        if arrived:
            self._store(arrived)

    def join(self) -> None:
        """Waits for every call in flight and commits its answer."""
        while self.busy():
            self.collect(wait_seconds=1)

    def _start(self) -> None:
        room = self.limit - len(self._running)
        if room <= 0 or not self._waiting:
            return
        starting, self._waiting = self._waiting[:room], self._waiting[room:]
        reads = [c for c in starting if is_light(c.tool)]  # `submitting` since their claim
        try:
            writes, stopped = submit_many(
                [c for c in starting if not is_light(c.tool)], now=timezone.now()
            )
        except Exception:  # nothing was sent: their leases run out, and they are retried (§7)
            logger.exception("%d calls could not be marked submitting", len(starting))
            writes, stopped = (
                [],
                {c.step.pk: Outcome.SKIPPED for c in starting if not is_light(c.tool)},
            )
        self.ends.update(stopped)
        self.keeper.release([c for c in starting if c.step.pk in stopped])
        loop = calls.call_loop()
        for c in reads + writes:
            context = {**logcontext.current(), **log_fields(c.step, c.attempt)}
            self._running[loop.start(c.tool, call_of(c), context)] = c

    def _store(self, arrived: list[tuple[Claim, calls.Answer]]) -> None:
        reads = [(c, a) for c, a in arrived if is_light(c.tool)]
        writes = [(c, a) for c, a in arrived if not is_light(c.tool)]
        try:
            if reads:
                self.ends.update(
                    commits.store_answers(*zip(*reads, strict=True), target=State.COMPLETED)
                )
            if writes:
                ends = commits.store_answers(*zip(*writes, strict=True), target=State.VERIFYING)
                self.ends.update(ends)
                self.ends.update(
                    verify_many([c for c, _ in writes if ends[c.step.pk] == State.VERIFYING])
                )
        except Exception:  # their leases run out, and recovery takes them from there (§7)
            logger.exception("%d answers could not be committed", len(arrived))
            for c, _ in arrived:
                self.ends.setdefault(c.step.pk, Outcome.SKIPPED)
        finally:
            self.keeper.release([c for c, _ in arrived])
