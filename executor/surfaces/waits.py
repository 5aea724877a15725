"""Long-polls (`GET /steps/{id}?wait=N`) waited on an event loop: no thread and no database
connection held while they wait (issue 22).

Every wait of one event loop is watched by one task, which reads the versions of all the
steps waited on in one query a tick (WAIT_POLL_SECONDS), on a thread of its own with a
connection of its own: a hundred waits cost one indexed read every 0.2 s, not a hundred, and
hold one connection, not a hundred. A step a tick cannot see (not committed where the
watcher reads, or the read failed) is no news: its waits go on until their time is up.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
import weakref
from concurrent.futures import ThreadPoolExecutor

from django.db import DatabaseError, close_old_connections, connection

from executor.ledger.records import Step

logger = logging.getLogger(__name__)

WAIT_POLL_SECONDS = 0.2
# The watcher's reads: one thread a process, so one database connection, whatever the waits.
_READER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stepward-waits")


def _versions(step_ids: list[uuid.UUID]) -> dict[uuid.UUID, int]:
    try:
        return dict(Step.objects.filter(pk__in=step_ids).values_list("pk", "version"))
    except DatabaseError:
        # A connection the server closed (a restart) is replaced at the next tick.
        logger.warning("long-poll watch: reading %d steps' versions failed", len(step_ids))
        connection.close()
        return {}
    finally:
        # As at a request's end: under ASGI (CONN_MAX_AGE 0) the connection goes back to
        # the pool between ticks; under WSGI it is kept, as a request thread keeps its own.
        close_old_connections()


class Watch:
    """The waits of one event loop, and the task that reads their steps' versions."""

    def __init__(self) -> None:
        self._waits: dict[uuid.UUID, list[tuple[int, asyncio.Future[None]]]] = {}
        self._task: asyncio.Task[None] | None = None

    async def changed(self, step_id: uuid.UUID, seen: int, seconds: float) -> bool:
        """True once the step's version differs from `seen`; False after `seconds`."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        entry = (seen, future)
        self._waits.setdefault(step_id, []).append(entry)
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._watch())
        try:
            await asyncio.wait_for(asyncio.shield(future), timeout=seconds)
            return True
        except TimeoutError:
            return False
        finally:
            waiting = self._waits.get(step_id, [])
            if entry in waiting:
                waiting.remove(entry)
            if not waiting:
                self._waits.pop(step_id, None)

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        while self._waits:
            await asyncio.sleep(WAIT_POLL_SECONDS)
            versions = await loop.run_in_executor(_READER, _versions, list(self._waits))
            for step_id, waiting in list(self._waits.items()):
                current = versions.get(step_id)
                for seen, future in waiting:
                    if current is not None and current != seen and not future.done():
                        future.set_result(None)


_watches: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Watch] = weakref.WeakKeyDictionary()


def watch() -> Watch:
    """The running event loop's watch (made on first use)."""
    loop = asyncio.get_running_loop()
    found = _watches.get(loop)
    if found is None:
        found = _watches[loop] = Watch()
    return found


async def until_changed(step_id: uuid.UUID, seen: int, seconds: float) -> bool:
    """True once the step's version differs from `seen`; False after `seconds`."""
    return await watch().changed(step_id, seen, seconds)
