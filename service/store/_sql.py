"""SQL both backends need written their own way: INSERT ... ON CONFLICT, id lists, bulk rows."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

from sqlalchemy import (
    JSON,
    ColumnElement,
    Integer,
    Select,
    Text,
    any_,
    cast,
    column,
    func,
    literal,
    select,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import InstrumentedAttribute, Session

from service.db import json_dumps
from service.models import (
    Base,
    PackStatus,
    TrialStatus,
)

StatusT = TypeVar("StatusT", TrialStatus, PackStatus)


def insert_for(s: Session, model: type[Base]) -> postgresql.Insert | sqlite.Insert:
    """The dialect's INSERT, which knows ``ON CONFLICT``."""
    backend = s.get_bind().dialect.name
    if backend == "postgresql":
        return postgresql.insert(model)
    if backend == "sqlite":
        return sqlite.insert(model)
    raise NotImplementedError(f"unsupported database backend: {backend}")


def statuses(status: StatusT | Iterable[StatusT]) -> list[StatusT]:
    if isinstance(status, TrialStatus | PackStatus):
        return [status]  # type: ignore[list-item]
    return list(status)


def fresh(stmt: Select[Any]) -> Select[Any]:
    # Rows may have changed under objects already in the session (upserts and
    # conditional UPDATEs run below the ORM), so reads overwrite them.
    return stmt.execution_options(populate_existing=True)


def id_in(
    s: Session, column: ColumnElement[int] | InstrumentedAttribute[int], ids: Sequence[int]
) -> ColumnElement[bool]:
    """``column IN (ids)``; on PostgreSQL ``column = ANY(:ids)``, one array parameter (see
    docs/design.md, "Data layer: what was measured")."""
    if is_postgres(s):
        return column == any_(literal(list(ids), postgresql.ARRAY(Integer)))
    return column.in_(list(ids))


def is_postgres(s: Session) -> bool:
    return s.get_bind().dialect.name == "postgresql"


def insert_rows(
    s: Session, model: type[Base], rows: Sequence[dict[str, Any]]
) -> tuple[postgresql.Insert | sqlite.Insert, list[dict[str, Any]] | None]:
    """An INSERT of ``rows`` (dicts with the same keys, JSON-able values) and the parameters to
    execute it with; the caller adds ``ON CONFLICT`` and ``RETURNING``.

    On PostgreSQL a single statement selecting from ``json_to_recordset()`` of one JSON
    text parameter, the fastest of the ways measured (docs/design.md, "Data layer: what
    was measured").
    """
    stmt = insert_for(s, model)
    if not is_postgres(s):
        return stmt, list(rows)
    table = model.__table__
    names = list(rows[0])
    as_json = {name for name in names if isinstance(table.c[name].type, JSON)}
    payload = json.dumps(
        [{name: recordset_value(row[name], name in as_json) for name in names} for row in rows],
        allow_nan=False,
    )
    source = (
        func.json_to_recordset(cast(literal(payload, Text), JSON))
        .table_valued(*(column(n, Text if n in as_json else table.c[n].type) for n in names))
        .render_derived(with_types=True)
    )
    picked = [cast(source.c[n], JSON) if n in as_json else source.c[n] for n in names]
    return stmt.from_select(names, select(*picked)), None


def recordset_value(value: Any, as_json: bool) -> Any:
    """``value`` as ``json_to_recordset`` reads it back: JSON columns as their text (written
    as every JSON column is), non-finite floats as the words PostgreSQL's float input takes."""
    if as_json:
        return json_dumps(value)
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    return value
