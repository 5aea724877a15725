"""The reviewers' console. Region URLs answer the same 404 as their pages for a hidden object."""

from __future__ import annotations

from django.urls import path

from console import views

urlpatterns = [
    path("", views.inbox, name="inbox"),
    path("nav/counts/", views.nav_counts, name="nav_counts"),
    path("deadletters/replay/", views.deadletters_replay, name="deadletters_replay"),
    path("steps/bulk/", views.steps_bulk_decide, name="steps_bulk_decide"),
    path("decisions/", views.decisions_list, name="decisions"),
    path("steps/<uuid:pk>/", views.step_page, name="step"),
    path("steps/<uuid:pk>/live/", views.step_live, name="step_live"),
    path("steps/<uuid:pk>/claim/", views.step_claim, name="step_claim"),
    path("steps/<uuid:pk>/release/", views.step_release, name="step_release"),
    path("steps/<uuid:pk>/decisions/", views.step_decisions, name="step_decisions"),
    path("steps/<uuid:pk>/timeline/", views.step_timeline, name="step_timeline"),
    # Every decision of executor/services/decisions.py, by its name.
    path("steps/<uuid:pk>/decide/<slug:name>/", views.step_decide, name="step_decide"),
    path("runs/", views.runs, name="runs"),
    path("runs/<uuid:pk>/", views.run_page, name="run"),
    path("runs/<uuid:pk>/live/", views.run_live, name="run_live"),
    path("runs/<uuid:pk>/extend/", views.run_extend, name="run_extend"),
    path("drills/", views.drills, name="drills"),
    path("drills/<int:pk>/", views.drill_page, name="drill"),
]
