"""The recovery drills' list and page in the console."""

from __future__ import annotations

from datetime import timedelta

from django.test import Client
from django.urls import reverse
from django.utils import timezone

from executor.models import DrillReport
from tests.console.conftest import read


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
