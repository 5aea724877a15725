"""The reviewers' console. Region URLs answer the same 404 as their pages for a hidden object."""

from __future__ import annotations

from django.urls import path

from console import views

urlpatterns = [
    path("", views.inbox, name="inbox"),
    path("nav/counts/", views.nav_counts, name="nav_counts"),
    path("deadletters/replay/", views.deadletters_replay, name="deadletters_replay"),
    path("steps/<uuid:pk>/", views.step_page, name="step"),
    path("steps/<uuid:pk>/decisions/", views.step_decisions, name="step_decisions"),
    path("steps/<uuid:pk>/timeline/", views.step_timeline, name="step_timeline"),
    path("steps/<uuid:pk>/approve/", views.step_approve, name="step_approve"),
    path("steps/<uuid:pk>/reject/", views.step_reject, name="step_reject"),
    path("steps/<uuid:pk>/resolve/", views.step_resolve, name="step_resolve"),
    path("steps/<uuid:pk>/probe/", views.step_probe, name="step_probe"),
    path("steps/<uuid:pk>/replay/", views.step_replay, name="step_replay"),
    path("steps/<uuid:pk>/resume/", views.step_resume, name="step_resume"),
    path("steps/<uuid:pk>/compensate/", views.step_compensate, name="step_compensate"),
    path("runs/", views.runs, name="runs"),
    path("runs/<uuid:pk>/", views.run_page, name="run"),
    path("runs/<uuid:pk>/live/", views.run_live, name="run_live"),
    path("runs/<uuid:pk>/extend/", views.run_extend, name="run_extend"),
    path("drills/", views.drills, name="drills"),
    path("drills/<int:pk>/", views.drill_page, name="drill"),
]
