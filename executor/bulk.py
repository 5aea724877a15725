"""One UPDATE for many rows whose new values differ row by row (the batches of DESIGN.md §14).

Django's `bulk_update` writes every field as a CASE over every row; here the fields that are
the same for every row stay plain values, and only the ones that differ become a CASE.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.db import connection
from django.db.models import Case, Model, QuerySet, Value, When
from django.db.models.functions import Cast


def case_by_pk(model: type[Model], field_name: str, values: Mapping[Any, Any]) -> Any:
    """`CASE WHEN pk = … THEN … END` for one field, typed as the field is."""
    field = model._meta.get_field(field_name)
    whens = [
        When(pk=pk, then=value if hasattr(value, "resolve_expression") else Value(value, field))  # type: ignore[arg-type]
        for pk, value in values.items()
    ]
    case = Case(*whens, output_field=field)  # type: ignore[arg-type]
    if connection.features.requires_casted_case_in_updates:
        return Cast(case, output_field=field)  # type: ignore[arg-type]
    return case


def update_rows(
    queryset: QuerySet[Any],
    *,
    same: Mapping[str, Any],
    per_row: Mapping[str, Mapping[Any, Any]],
) -> int:
    """Updates `queryset`'s rows: `same` values for all, `per_row[field][pk]` where they differ.

    Every row the queryset selects must appear in each `per_row` mapping. Returns how many
    rows changed.
    """
    values: dict[str, Any] = dict(same)
    for name, by_pk in per_row.items():
        distinct = {repr(v) for v in by_pk.values()}
        if len(distinct) == 1:
            values[name] = next(iter(by_pk.values()))
        else:
            values[name] = case_by_pk(queryset.model, name, by_pk)
    return queryset.update(**values)
