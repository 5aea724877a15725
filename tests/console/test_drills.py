"""The recovery drills' list and page in the console."""

from __future__ import annotations

from datetime import timedelta

from django.test import Client
from django.urls import reverse
from django.utils import timezone

from executor.ledger.records import DrillReport
from tests.support.console import read


def drill(**fields: object) -> DrillReport:
    now = timezone.now()
    defaults: dict[str, object] = {
        "version": "0.1.0+abc1234",
        "started_at": now - timedelta(minutes=2),
        "finished_at": now,
        "parameters": {"steps": 300, "workers": 2, "seed": 7},
        "interruption_points": {"before_invoke": 0.05, "after_submit": 0.05},
        "counts": {"completed": 298, "unknown": 2},
        "left_for_review": 2,
        "elapsed_seconds": 110.0,
        "passed": True,
    }
    return DrillReport.objects.create(**{**defaults, **fields})


def test_the_drills_list_shows_each_drill_with_its_verdict(bob: Client) -> None:
    passed = drill()
    failed = drill(passed=False, duplicates=3, notes="drill-00021 has 4 tickets")

    page = read(bob.get(reverse("drills")))

    assert sum(1 for _, attrs in page.elements if attrs.get("data-testid") == "drills-row") == 2
    # Newest first, each with its verdict.
    newest, oldest = (
        page.text.index(f"Drill {failed.pk} failed"),
        page.text.index(f"Drill {passed.pk} passed"),
    )
    assert newest < oldest


def test_a_drill_page_shows_its_counts_points_and_notes(bob: Client) -> None:
    report = drill(passed=False, duplicates=3, notes="drill-00021 has 4 tickets [14, 20]\n")

    page = read(bob.get(reverse("drill", args=[report.pk])))

    assert {"drill-verdict", "drill-outcome", "drill-points", "drill-notes"} <= page.testids()
    assert f"Drill {report.pk} failed" in page.text
    assert "Duplicates found 3" in page.text
    assert "completed 298" in page.text
    assert "after_submit 0.05" in page.text
    assert "drill-00021 has 4 tickets [14, 20]" in page.text


# The shape `manage.py drill` writes (executor/drill/runner.py: interruption_points).
POINTS = {
    "worker": {
        "before_invoke": {"rate": 0.05, "hits": 4},
        "after_submit": {"rate": 0.05, "hits": 6},
    },
    "desk": {
        "503": {"rate": 0.1, "injected": 31},
        "drop": {"rate": 0.05, "injected": 12},
        "stale_fence_refused": 2,
    },
    "desk_latency_ms": 20.0,
    "kills": {"every_seconds": 7.0, "done": 9},
    "freezes": {"every_seconds": 11.0, "seconds": 40.0, "done": 3},
    "worker_crashes": 10,
    "fenced_out_attempts": 5,
}


def test_a_drill_page_shows_its_disturbances_as_tables(bob: Client) -> None:
    report = drill(
        interruption_points=POINTS,
        parameters={"steps": 320, "tools": ["echo", "ticketdesk.create"], "seed": 7},
    )
    response = bob.get(reverse("drill", args=[report.pk]))
    page = read(response)
    body = response.content.decode()
    assert {"drill-disturbances", "drill-worker-points", "drill-desk-faults"} <= page.testids()
    assert "Workers killed (SIGKILL) 9 every 7 s" in page.text
    assert "Workers frozen past their lease 3 every 11 s" in page.text
    assert "Stale fences refused by the desk 2" in page.text
    assert "Stale fences refused by the ledger 5" in page.text
    assert "after_submit 0.05 6" in page.text
    assert "503 0.1 31" in page.text
    assert "tools echo, ticketdesk.create" in page.text
    assert "20 ms of added latency" in page.text
    # No Python structure leaks into the page.
    assert "{" not in page.text
    assert "[" not in page.text
    assert "&#x27;" not in body


def test_no_drill_yet_is_a_clear_empty_state(bob: Client) -> None:
    page = read(bob.get(reverse("drills")))
    assert "drills-empty" in page.testids()
    assert "No drill has run yet" in page.text


def test_drills_need_a_sign_in(client: Client, db: None) -> None:
    report = drill()
    for url in (reverse("drills"), reverse("drill", args=[report.pk])):
        response = client.get(url)
        assert response.status_code == 302
        assert response["Location"].startswith("/accounts/login/")


def test_an_unknown_drill_is_404(bob: Client) -> None:
    assert bob.get(reverse("drill", args=[999999])).status_code == 404
