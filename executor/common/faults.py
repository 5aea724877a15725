"""Named interruption points (DESIGN.md §5) that end the worker process for real.

`EXECUTOR_FAULTS` gives a rate per point (`after_submit:0.2,before_persist:0.1`). A hit
calls `os._exit`: no `finally`, no rollback hook, no acknowledgement — a crash, not an
exception. Faults are refused unless `EXECUTOR_ALLOW_FAULTS=1`, and a worker configured
with faults but without that permission refuses to start.
"""

from __future__ import annotations

import logging
import os
import random
import sys
import threading

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

logger = logging.getLogger(__name__)

POINTS = ("before_invoke", "after_submit", "before_persist")
# The exit status of a process killed by SIGKILL, so supervisors treat both alike.
CRASH_EXIT_STATUS = 137

_rates: dict[str, float] | None = None
_rng = random.Random()
# Held by the thread that ends the process: a second thread hitting a point meanwhile (the
# call loop's and the drain's) waits here, so each logged hit is one ending.
_ending = threading.Lock()


def parse(spec: str) -> dict[str, float]:
    """Parses `point:rate,point:rate`; raises ImproperlyConfigured on anything else."""
    rates: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        point, sep, value = item.partition(":")
        if not sep or point not in POINTS:
            raise ImproperlyConfigured(
                f"EXECUTOR_FAULTS: {item!r} is not point:rate with a point of {', '.join(POINTS)}"
            )
        try:
            rate = float(value)
        except ValueError:
            raise ImproperlyConfigured(f"EXECUTOR_FAULTS: {value!r} is not a number") from None
        if not 0 <= rate <= 1:
            raise ImproperlyConfigured(f"EXECUTOR_FAULTS: rate {rate} is outside [0, 1]")
        rates[point] = rate
    return rates


def configured_rates() -> dict[str, float]:
    global _rates
    if _rates is None:
        rates = parse(settings.EXECUTOR_FAULTS)
        if rates and not settings.EXECUTOR_ALLOW_FAULTS:
            raise ImproperlyConfigured(
                "EXECUTOR_FAULTS is set but fault injection is not allowed: "
                "set EXECUTOR_ALLOW_FAULTS=1 (test and drill machines only)"
            )
        seed = os.environ.get("EXECUTOR_FAULTS_SEED")
        if seed:
            _rng.seed(f"{seed}:{os.getpid()}")
        _rates = rates
    return _rates


def reset() -> None:
    """Forgets the parsed rates (tests change settings between cases)."""
    global _rates
    _rates = None


def check_startup() -> None:
    """Called when a worker starts: refuses faults that are not allowed."""
    rates = configured_rates()
    if rates:
        logger.warning("fault injection is ON: %s", rates)


def hit(point: str) -> None:
    """Ends the process at `point` with its configured probability."""
    rate = configured_rates().get(point, 0.0)
    if rate and _rng.random() < rate:
        _ending.acquire()
        logger.warning("fault injected at %s: the process ends now", point)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(CRASH_EXIT_STATUS)
