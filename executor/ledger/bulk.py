"""Many rows in one statement (the batches of DESIGN.md §14).

`update_rows`: one UPDATE for many rows whose new values differ row by row. Django's
`bulk_update` writes every field as a CASE over every row; here the fields that are the same
for every row stay plain values, and only the ones that differ become a CASE.

`insert_together`: new rows of several models in one statement (PostgreSQL).
"""

from __future__ import annotations

import functools
import operator
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.db import connection, connections, models
from django.db.models import Case, Field, Model, QuerySet, Value, When
from django.db.models.expressions import RawSQL
from django.db.models.functions import Cast


def case_by_pk(model: type[Model], field_name: str, values: Mapping[Any, Any]) -> Any:
    """`CASE WHEN pk = … THEN … END` for one field, typed as the field is.

    On PostgreSQL, where the values are plain (no expressions), the same as two arrays
    instead: `(values)[array_position(pks, pk)]`. Its SQL does not grow with the rows, and it
    is one node for the ORM to compile where the CASE is a `When` and a lookup a row (most
    of the CPU a worker spent on a batch's UPDATEs).
    """
    field = model._meta.get_field(field_name)
    db = connections[connection.alias]
    if db.vendor == "postgresql" and not any(
        hasattr(value, "resolve_expression") for value in values.values()
    ):
        pk = model._meta.pk
        assert pk is not None
        assert isinstance(field, Field)
        column = (
            f"{db.ops.quote_name(model._meta.db_table)}.{db.ops.quote_name(pk.column or pk.name)}"
        )
        sql = (
            f"(%s::{_array_type(field, db)}[])"
            f"[array_position(%s::{_array_type(pk, db)}[], {column})]"
        )
        return RawSQL(  # noqa: S611 - names and types are ours; values are parameters
            sql,
            (
                [field.get_db_prep_save(value, db) for value in values.values()],
                [pk.get_db_prep_value(key, db) for key in values],
            ),
            output_field=field,
        )
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


def update_sql(
    model: type[Model],
    values: Mapping[str, Any],
    *,
    where: Mapping[str, Any],
    increments: Mapping[str, Any] | None = None,
    condition: str = "",
    condition_params: Sequence[Any] = (),
) -> tuple[str, list[Any]]:
    """`UPDATE table SET field = value, … , field = field + n WHERE field = value AND …
    [AND condition] RETURNING 1`, with every value prepared as the ORM prepares it: a part
    of a statement of CTEs (`insert_together`'s `ctes`) that changes a row only together with
    others (PostgreSQL). It answers a 1 for each row it changed."""
    db = connections[connection.alias]
    meta = model._meta

    def field_of(name: str) -> tuple[Field[Any, Any], str]:
        f = meta.pk if name == "pk" else meta.get_field(name)
        assert isinstance(f, Field)
        return f, db.ops.quote_name(f.column or f.name)

    sets: list[str] = []
    params: list[Any] = []
    for name, value in values.items():
        f, column = field_of(name)
        sets.append(f"{column} = %s")
        params.append(f.get_db_prep_save(value, db))
    for name, step in (increments or {}).items():
        f, column = field_of(name)
        sets.append(f"{column} = {column} + %s")
        params.append(f.get_db_prep_save(step, db))
    tests: list[str] = []
    for name, value in where.items():
        f, column = field_of(name)
        tests.append(f"{column} = %s")
        params.append(f.get_db_prep_value(value, db))
    if condition:
        tests.append(f"({condition})")
        params.extend(condition_params)
    sql = (
        f"UPDATE {db.ops.quote_name(meta.db_table)} SET {', '.join(sets)} "  # noqa: S608 - names
        f"WHERE {' AND '.join(tests)} RETURNING 1"
    )
    return sql, params


# --- new rows of several tables in one statement (PostgreSQL) --------------------------------


@dataclass(frozen=True)
class Computed:
    """A column computed in SQL from values given per row: `sql` names them `{0}`, `{1}`, …
    (each of the SQL type in `types`); `values` gives them for one object."""

    sql: str
    types: tuple[str, ...]
    values: Callable[[Any], tuple[Any, ...]]


@dataclass
class Rows:
    """New rows of one model for `insert_together`; `columns` computes some fields in SQL;
    `where`, a condition on the statement's CTEs, inserts them only if it holds."""

    model: type[Model]
    objs: Sequence[Model]
    columns: Mapping[str, Computed] = field(default_factory=dict)
    where: str = ""


def insert_together(
    rows: Sequence[Rows], *, ctes: Sequence[tuple[str, str, list[Any]]] = ()
) -> dict[str, list[Any]]:
    """Inserts every group of `rows` in one statement of data-modifying CTEs (PostgreSQL): one
    round trip, atomic by itself, where `bulk_create` of each model in a transaction costs
    BEGIN, an INSERT a model and COMMIT.

    Each column's values travel as one array (`INSERT … SELECT … FROM unnest(…)`, as
    `bulk_create` does on PostgreSQL): the statement's text and its number of parameters do
    not grow with the rows, so it is parsed in no time, prepared once for every size, and
    far below the protocol's 65,535 parameters.

    `ctes` (name, SQL, parameters) come first, for `columns` to read from; each returns one
    column, and the answer maps each name to its values. Sets the objects' generated primary
    keys, as `bulk_create` does.
    """
    parts = [f"{name} AS ({sql})" for name, sql, _ in ctes]
    params: list[Any] = [p for _, _, cte_params in ctes for p in cte_params]
    # Each part of the answer is tagged: -1, -2, … the CTEs; 0, 1, … the groups' keys.
    # Names, types and numbers are ours; every value is a parameter.
    answers = [f"SELECT {-1 - index}, * FROM {name}" for index, (name, _, _) in enumerate(ctes)]  # noqa: S608
    for number, group in enumerate(rows):
        if not group.objs:
            continue
        insert, arrays = _insert_unnest(group)
        params.extend(arrays)
        pk = group.model._meta.pk
        if pk is not None and pk.db_returning:
            insert += f" RETURNING {connection.ops.quote_name(pk.column or pk.name)}"
            answers.append(f"SELECT {number}, * FROM i{number}")  # noqa: S608
        parts.append(f"i{number} AS ({insert})")
    found: dict[int, list[Any]] = {}
    if len(parts) > len(ctes):
        # Rows come back in the order of the arrays, as `bulk_create` relies on too.
        answer = " UNION ALL ".join(answers) or "SELECT -1, NULL WHERE FALSE"
        with connection.cursor() as cursor:
            cursor.execute(f"WITH {', '.join(parts)} {answer}", params)
            for tag, value in cursor.fetchall():
                found.setdefault(tag, []).append(value)
    for number, group in enumerate(rows):
        keys = iter(found.get(number, ()))
        for obj in group.objs:
            if number in found:
                obj.pk = next(keys)
            obj._state.adding = False
            obj._state.db = connection.alias
    return {name: found.get(-1 - index, []) for index, (name, _, _) in enumerate(ctes)}


def create(model: type[Model], objs: Sequence[Model]) -> None:
    """`model.objects.bulk_create(objs)`; on PostgreSQL the same INSERT … SELECT FROM unnest
    through `insert_together`, its arrays built without the ORM's work for every object and
    field (a third of the CPU of a batch's move of many steps, py-spy)."""
    if connection.vendor == "postgresql":
        insert_together([Rows(model, objs)])
    else:
        model._default_manager.bulk_create(objs)


def _array_type(f: Field[Any, Any], db: Any) -> str:
    """The SQL type of an array of `f`'s values: without its length (varchar, not
    varchar(200)), as bulk_create does."""
    return str(f.db_type(db)).split("(")[0]


# Field classes whose `get_db_prep_save` hands a value of exactly these Python types back
# unchanged on PostgreSQL (str for text, a UUID where the backend stores uuids natively, an
# aware datetime): `_prepare` skips the call for them. Not integers: Django wraps them in
# psycopg's type of their column. Exact classes only: a subclass may prepare its values its
# own way. tests/executor/test_bulk.py holds this to `get_db_prep_save` for every field of
# the models inserted in bulk.
_SENT_AS_THEY_ARE: dict[type[Field[Any, Any]], type] = {
    models.CharField: str,
    models.TextField: str,
    models.UUIDField: uuid.UUID,
    models.DateTimeField: datetime,
}


def _prepare(f: Field[Any, Any], db: Any) -> Callable[[Any], Any]:
    """`f.get_db_prep_save` for one column's values, skipping it where it would hand a
    value back unchanged (`_SENT_AS_THEY_ARE`; None where the field is nullable)."""
    target = f.target_field if isinstance(f, models.ForeignKey) else f
    prep = f.get_db_prep_save
    kind = _SENT_AS_THEY_ARE.get(type(target))
    if (
        db.vendor != "postgresql"
        or kind is None
        or (kind is uuid.UUID and not db.features.has_native_uuid_field)
    ):
        return lambda value: prep(value, db)
    none_ok = f.null
    aware_only = kind is datetime  # a naive one is made aware (with a warning)

    def prepare(value: Any) -> Any:
        if type(value) is kind and not (aware_only and value.tzinfo is None):  # type: ignore[attr-defined]
            return value
        if value is None and none_ok:
            return None
        return prep(value, db)

    return prepare


# The kinds of value a column may be sent once for, when every row holds an equal one of the
# same type: equal means the same stored value for these. Not a JSON document: {"v": 1},
# {"v": True} and {"v": 1.0} are equal in Python and three different inputs. Not a float
# either (0.0 == -0.0).
_FOLDABLE = frozenset({str, int, bool, type(None), uuid.UUID, datetime})


@dataclass(frozen=True)
class _Shape:
    """What `_insert_unnest` needs of a model, worked out once: its inserted fields, each
    one's array type, quoted column and preparation."""

    table: str
    fields: tuple[Field[Any, Any], ...]
    types: tuple[str, ...]
    columns: tuple[str, ...]
    prepare: tuple[Callable[[Any], Any], ...]
    # pre_save where the field computes its value (auto_now), else the attribute itself.
    read: tuple[Callable[[Any], Any], ...]


@functools.cache
def _shape(model: type[Model], alias: str) -> _Shape:
    db = connections[alias]
    meta = model._meta
    pk = meta.pk
    generated = pk is not None and pk.db_returning
    fields = tuple(f for f in meta.concrete_fields if not (generated and f is pk))
    return _Shape(
        table=db.ops.quote_name(meta.db_table),
        fields=fields,
        types=tuple(_array_type(f, db) for f in fields),
        columns=tuple(db.ops.quote_name(f.column or f.name) for f in fields),
        prepare=tuple(_prepare(f, db) for f in fields),
        read=tuple(_reader(f) for f in fields),
    )


def _reader(f: Field[Any, Any]) -> Callable[[Any], Any]:
    if type(f).pre_save is Field.pre_save:
        return operator.attrgetter(f.attname)
    return lambda obj: f.pre_save(obj, True)


def _insert_unnest(group: Rows) -> tuple[str, list[Any]]:
    """`INSERT INTO table (…) SELECT … FROM unnest(%s::type[], …)` for the group's objects,
    and its parameters: an array of a column's values (or of one input of a computed
    column). A column whose value is the same in every row is one value instead (every
    column of a single post; a batch's run, times, defaults), so psycopg packs and the
    server unpacks no array for it."""
    # The connection itself, not the proxy that finds it at every attribute (thousands here).
    db = connections[connection.alias]
    shape = _shape(group.model, db.alias)
    # Arrays in binary where the server binds the parameters: psycopg packs each value as it
    # is instead of quoting and escaping it as text (about 2.5 times faster here).
    mark = "%b" if db.settings_dict["OPTIONS"].get("server_side_binding") else "%s"
    objs = group.objs
    params: list[Any] = []  # the arrays, then the constants: their order in the text
    arrays: list[str] = []  # `%b::type[]`, one an array
    scalars: list[str] = []  # `%b::type AS cN`, one a value the same in every row
    constants: list[Any] = []
    selected: list[str] = []

    def column(values: list[Any], sql_type: str, prepare: Callable[[Any], Any]) -> str:
        first = values[0]
        kind = type(first)
        if kind in _FOLDABLE and all(type(value) is kind and value == first for value in values):
            scalars.append(f"{mark}::{sql_type} AS c{len(scalars)}")
            constants.append(prepare(first))
            return f"k.c{len(scalars) - 1}"
        arrays.append(f"{mark}::{sql_type}[]")
        params.append([prepare(value) for value in values])
        return f"u.v{len(arrays) - 1}"

    for f, sql_type, prepare, read in zip(
        shape.fields, shape.types, shape.prepare, shape.read, strict=True
    ):
        computed = group.columns.get(f.name)
        if computed is None:
            selected.append(column([read(obj) for obj in objs], sql_type, prepare))
            continue
        inputs = [computed.values(obj) for obj in objs]
        names = [
            column([values[index] for values in inputs], input_type, _as_is)
            for index, input_type in enumerate(computed.types)
        ]
        selected.append(f"({computed.sql.format(*names)})")
    # The rows: the arrays side by side (or as many rows as objects, when no column
    # differs), each beside the one row of the values that are the same in all of them.
    if arrays:
        aliases = ", ".join(f"v{index}" for index in range(len(arrays)))
        rows = f"unnest({', '.join(arrays)}) AS u({aliases})"
    else:
        rows = f"generate_series(1, {len(objs):d})"
    if scalars:
        rows += f", (SELECT {', '.join(scalars)}) AS k"
    sql = (
        f"INSERT INTO {shape.table} ({', '.join(shape.columns)}) "  # noqa: S608 - names, types
        f"SELECT {', '.join(selected)} FROM {rows}"
    )
    if group.where:
        sql += f" WHERE {group.where}"
    return sql, [*params, *constants]


def _as_is(value: Any) -> Any:
    return value
