"""Template helpers of the console: times shown relative and absolute, bars, evidence."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from django import template
from django.utils import timezone
from django.utils.html import format_html

from executor.common.redaction import redact, redact_text

register = template.Library()

UNITS = ((86400 * 365, "y"), (86400 * 30, "mo"), (86400, "d"), (3600, "h"), (60, "min"))


def relative(value: datetime, now: datetime | None = None) -> str:
    """'3 min ago', 'in 2 h', 'just now': the largest whole unit, rounded down."""
    now = now or timezone.now()
    seconds = (now - value).total_seconds()
    future = seconds < 0
    seconds = abs(seconds)
    if seconds < 45:
        return "just now" if not future else "in a few seconds"
    for size, unit in UNITS:
        if seconds >= size:
            amount = f"{int(seconds // size)} {unit}"
            return f"in {amount}" if future else f"{amount} ago"
    return "in 1 min" if future else "1 min ago"


@register.simple_tag
def timestamp(value: datetime | None) -> str:
    """A <time> that reads relative and names the absolute UTC time in its title, with the
    absolute time beside it (a team compares times across screens and shifts)."""
    if value is None:
        return "—"
    utc = value.astimezone(UTC)
    absolute = utc.strftime("%Y-%m-%d %H:%M:%S UTC")
    return format_html(
        '<time datetime="{}" title="{}">{}</time> <span class="abs-time">{}</span>',
        value.isoformat(),
        absolute,
        relative(value),
        utc.strftime("%Y-%m-%d %H:%M UTC"),
    )


@register.filter
def redacted(value: Any) -> str:
    """Free text (a reason, a failure message, a summary) with anything shaped like a
    secret replaced (DESIGN.md §15): every page shows people's words through this."""
    if value is None:
        return ""
    return redact_text(str(value))


@register.filter
def percent_of(value: Any, limit: Any) -> str:
    """How full a bar is, 0 to 100 (its SVG width); 0 when there is no limit."""
    try:
        used, whole = float(value), float(limit)
    except (TypeError, ValueError):
        return "0"
    if whole <= 0:
        return "100" if used > 0 else "0"
    return f"{max(0.0, min(100.0, used * 100 / whole)):.1f}"


# The stacked bar is SVG geometry, not inline styles (the Content-Security-Policy allows
# none): each state's share of the width in percent, at least MIN_SEGMENT so that one step
# among thousands stays visible, less SEGMENT_GAP between neighbours.
MIN_SEGMENT = 1.0
SEGMENT_GAP = 0.4


@register.filter
def stack_segments(bar: list[tuple[str, int]]) -> list[dict[str, Any]]:
    """[(state, count)] as [{state, count, x, width}], x and width in percent of the bar."""
    counts = [(state, int(count)) for state, count in bar if int(count) > 0]
    total = sum(count for _, count in counts)
    if not total:
        return []
    shares = [max(MIN_SEGMENT, count * 100 / total) for _, count in counts]
    scale = 100 / sum(shares)
    segments, x = [], 0.0
    for index, ((state, count), share) in enumerate(zip(counts, shares, strict=True)):
        width = share * scale
        gap = SEGMENT_GAP if index < len(counts) - 1 else 0.0
        segments.append(
            {"state": state, "count": count, "x": f"{x:.2f}", "width": f"{width - gap:.2f}"}
        )
        x += width
    return segments


@register.filter
def pretty_json(value: Any) -> str:
    """JSON for people to read, with anything that looks like a secret redacted (§15)."""
    if value in (None, "", {}, []):
        return ""
    return json.dumps(redact(value), indent=2, sort_keys=True, ensure_ascii=False, default=str)


@register.filter
def get_item(mapping: Any, key: Any) -> Any:
    try:
        return mapping[key]
    except (KeyError, IndexError, TypeError):
        return None


@register.filter
def spaced(value: Any) -> str:
    """`budget_extended` → `budget extended`."""
    return str(value).replace("_", " ")
