"""How much one client may hold or try: long-polls held at once, failed authentications.

Both are kept in Django's cache: a shared cache (CACHE_URL pointing at Redis) makes them
hold across web processes; the default in-memory cache holds them within one process.
Only the cache's atomic operations are used (`add`, `incr`), each key with a TTL, so a web
process killed mid-request leaks nothing past that TTL.
"""

from __future__ import annotations

import hashlib
import math
import time
import uuid
from dataclasses import dataclass

from django.core.cache import cache
from django.core.exceptions import ImproperlyConfigured

PERIODS = {"s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "hour": 3600, "d": 86400, "day": 86400}


def parse_rate(rate: str) -> tuple[int, int] | None:
    """`"30/min"` → (30, 60); `""` or `"off"` → None (no limit)."""
    text = rate.strip().lower()
    if text in ("", "off", "none"):
        return None
    count, _, period = text.partition("/")
    try:
        number = int(count)
        seconds = PERIODS[period.strip()]
    except (ValueError, KeyError):
        raise ImproperlyConfigured(
            f"{rate!r} is not a rate like 30/min (periods: s, min, h, day) or off"
        ) from None
    if number < 1:
        raise ImproperlyConfigured(f"{rate!r}: the count must be at least 1")
    return number, seconds


def cache_safe(text: str) -> str:
    """A key part from any text (an address from a header may hold anything)."""
    return hashlib.sha256(text.encode("utf-8", "replace")).hexdigest()[:32]


# --- concurrency: at most N held at once -------------------------------------------------


@dataclass(frozen=True)
class Slot:
    key: str
    owner: str


class ConcurrencyLimit:
    """At most `limit` slots per holder at once; a slot frees when released or at its TTL.

    Each slot is its own key, taken with `cache.add` (SET NX EX on Redis), so taking one is
    atomic and every slot expires on its own. (One counter with incr/decr would have one
    TTL for all: set once, it could expire under waits still held; refreshed, a count
    leaked by a killed process would live as long as the agent keeps polling.)
    """

    def __init__(self, name: str) -> None:
        self.name = name

    def _keys(self, holder: str, limit: int) -> list[str]:
        return [f"stepward_{self.name}_{holder}_{number}" for number in range(limit)]

    def acquire(self, holder: str, *, limit: int, hold_seconds: float, ttl: float) -> Slot | None:
        """A free slot, taken for `hold_seconds` (told to those refused) and kept at most
        `ttl` seconds; None when all `limit` are held."""
        owner = uuid.uuid4().hex
        ends_at = time.time() + hold_seconds
        for key in self._keys(holder, limit):
            if cache.add(key, (owner, ends_at), timeout=math.ceil(ttl)):
                return Slot(key, owner)
        return None

    def release(self, slot: Slot) -> None:
        held = cache.get(slot.key)
        # Past its TTL the slot may be someone else's now: only our own is deleted.
        if isinstance(held, tuple) and held[0] == slot.owner:
            cache.delete(slot.key)

    def held(self, holder: str, *, limit: int) -> int:
        return len(cache.get_many(self._keys(holder, limit)))

    def seconds_until_free(self, holder: str, *, limit: int) -> float:
        """When the first held slot is due to be released (its holder's own deadline)."""
        ends = [
            held[1]
            for held in cache.get_many(self._keys(holder, limit)).values()
            if isinstance(held, tuple)
        ]
        return max(0.0, min(ends, default=time.time()) - time.time())


# --- rate: at most N per period ------------------------------------------------------------


class WindowLimit:
    """At most `count` hits per fixed window of `period` seconds per key.

    A fixed window (a counter per key and window, `add` then `incr`) is atomic on any cache;
    it lets up to twice the rate through across a window's edge, which is fine for a limit
    that only needs to make guessing and hammering slow.
    """

    def __init__(self, name: str) -> None:
        self.name = name

    def hit(self, key: str, *, count: int, period: int) -> float | None:
        """Counts one hit; None while within the limit, else the seconds until the window
        ends."""
        now = time.time()
        window = int(now // period)
        name = f"stepward_{self.name}_{key}_{window}"
        # Twice the period: the key cannot expire while its window is still counting.
        cache.add(name, 0, timeout=2 * period)
        try:
            hits = cache.incr(name)
        except ValueError:
            # Evicted between add and incr: count this one alone.
            cache.add(name, 1, timeout=2 * period)
            hits = 1
        if hits <= count:
            return None
        return (window + 1) * period - now
