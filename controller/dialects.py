"""The store's two databases: SQLite (a file path, the embedded default) and PostgreSQL (a `postgresql://` URL),
the engine each takes and the plain-statement connection the hot paths use on either (`raw`).

The hot paths (`work/hot_sql.py` and its callers) write their statements once, in SQLite's form (`?` parameters);
on PostgreSQL `raw` hands them a connection that rewrites each text once (`?` → `%s`, `:name` → `%(name)s`,
SQLite's `INDEXED BY` hint dropped) and runs it through psycopg, which prepares a statement it sees repeatedly.
Many rows at once are one statement over arrays on PostgreSQL (`update_by_id`, `insert_rows`). Next step: a statement
whose PostgreSQL form must differ in more than that gets its own text, chosen by `is_pg`.
"""
from __future__ import annotations

import re
from pathlib import Path
from functools import lru_cache
from typing import Any, Iterable, Sequence

from sqlalchemy import BigInteger, Table, literal
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.sql.elements import BindParameter

SQLITE, POSTGRESQL = "sqlite", "postgresql"
URL_SCHEMES = ("postgresql://", "postgres://", "postgresql+psycopg://")
# Per process: enough connections for the event loop's groups, the API's threads and the background passes.
PG_POOL, PG_OVERFLOW = 10, 30
# A session idle inside a transaction this long is ended by the server (idle_in_transaction_session_timeout): what a
# paused process locked (rows, a job's feed lock) holds the other replicas' writes at most this long (the controller,
# simulation and fault suites pass with it at 2 s); the node calls' owner rows are freed sooner (`shards.py`).
IDLE_IN_TRANSACTION_SECONDS = 60


def is_url(store: str | Path) -> bool:
    """Whether `--store` names a PostgreSQL server rather than an SQLite file."""
    return isinstance(store, str) and store.startswith(URL_SCHEMES)


def engine_url(url: str) -> str:
    """SQLAlchemy's name for the URL, with the psycopg 3 driver."""
    for scheme in URL_SCHEMES:
        if url.startswith(scheme):
            return "postgresql+psycopg://" + url[len(scheme):]
    raise ValueError(f"not a PostgreSQL URL: {url}")


def redacted(url: str) -> str:
    """The URL without its password, for logs and messages."""
    return re.sub(r"(://[^:/@]+):[^@]*@", r"\1:***@", url)


def is_pg(engine_or_conn: Engine | Connection) -> bool:
    return engine_or_conn.dialect.name == POSTGRESQL


_INDEXED_BY = re.compile(r"\bINDEXED BY \w+\s*", re.IGNORECASE)
_NAMED = re.compile(r"(?<![:\w]):(\w+)")
_texts: dict[str, str] = {}


def pg_text(sql: str) -> str:
    """A statement in SQLite's form, in psycopg's (cached: the hot paths repeat a few hundred texts)."""
    out = _texts.get(sql)
    if out is None:
        out = _INDEXED_BY.sub("", sql).replace("%", "%%").replace("?", "%s")
        out = _texts[sql] = _NAMED.sub(r"%(\1)s", out)
    return out


class PgRaw:
    """A psycopg connection that takes SQLite-form statements: `execute` (→ a cursor: fetchone, fetchall,
    iteration) and `executemany`, as the hot paths call sqlite3's."""

    __slots__ = ("pg",)

    def __init__(self, pg: Any) -> None:
        self.pg = pg

    def execute(self, sql: str, params: Any = ()) -> Any:
        return self.pg.execute(pg_text(sql), params if isinstance(params, dict) else (tuple(params) or None))

    def executemany(self, sql: str, rows: Iterable[Any]) -> None:
        rows = [r if isinstance(r, dict) else tuple(r) for r in rows]
        if rows:
            with self.pg.cursor() as cur:
                cur.executemany(pg_text(sql), rows)


def update_by_id(db: Any, table: Table, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
    """`UPDATE table SET columns WHERE id = ?` for each row (its columns' values, then its id; ids distinct). On
    PostgreSQL one statement over an array per column: psycopg's `executemany` is one pipelined statement per row,
    about twice the CPU of the loop per 64 rows (the benchmarks page, "Constants"); on SQLite `executemany`, a C loop
    in-process."""
    rows = list(rows)
    if not rows:
        return
    if not isinstance(db, PgRaw):
        db.executemany(f"UPDATE {table.name} SET {', '.join(f'{c} = ?' for c in columns)} WHERE id = ?", rows)
        return
    names = (*columns, "id")
    unnest, arrays = _unnest(table, names, rows)
    sets = ", ".join(f"{c} = v.{c}" for c in columns)
    db.pg.execute(f"UPDATE {table.name} SET {sets} FROM {unnest} AS v({', '.join(names)}) "
                  f"WHERE {table.name}.id = v.id", arrays)


def insert_rows(db: Any, table: Table, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
    """`INSERT INTO table (columns)` each row, in their order (an identity column's values follow it: the trainer
    feed's seqs). On PostgreSQL one statement over an array per column (psycopg's `executemany` cost ~125 µs of
    Python per row, holding the interpreter the event loop shares), `ORDER BY` the arrays' ordinality: a serial
    default is drawn in the order rows leave the sort. On SQLite `executemany`, row by row."""
    rows = list(rows)
    if not rows:
        return
    if not isinstance(db, PgRaw):
        db.executemany(f"INSERT INTO {table.name} ({', '.join(columns)}) VALUES {in_list(len(columns))}", rows)
        return
    names = ", ".join(columns)
    unnest, arrays = _unnest(table, tuple(columns), rows)
    db.pg.execute(f"INSERT INTO {table.name} ({names}) SELECT {names} FROM {unnest} WITH ORDINALITY "
                  f"AS v({names}, ordinal) ORDER BY ordinal", arrays)


def in_list(n: int) -> str:
    """`(?,?,…)`: n parameters."""
    return "(" + ",".join("?" * n) + ")"


def int64(value: int) -> BindParameter[int]:
    """`value` as a 64-bit parameter to compare an integer column with: SQLAlchemy casts a parameter to its column's
    type (`%s::INTEGER` for PostgreSQL's 32-bit serial ids), so a cursor or a resourceVersion past 2^31 was an error
    there (a 500). A value past int64 is clamped to it: as many rows lie beyond it (none) or before it (all)."""
    return literal(max(-(1 << 63), min(value, (1 << 63) - 1)), BigInteger)


@lru_cache(maxsize=None)
def _pg_types(table: Table, names: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(table.c[name].type.compile(dialect=postgresql.dialect()) for name in names)


_AS = {"FLOAT": float, "DOUBLE PRECISION": float, "REAL": float, "BOOLEAN": bool, "INTEGER": int, "BIGINT": int,
       "SMALLINT": int}


def _unnest(table: Table, names: tuple[str, ...], rows: list[Sequence[Any]]) -> tuple[str, list[list[Any]]]:
    """`unnest(%b::type[], …)` over the columns `names` of `table`, and its arrays: the rows as one list per column,
    each number or flag made its column's Python type (psycopg refuses a list of mixed types: a float column's int,
    an integer column's bool; and a binary array keeps its elements' type: 0/1 ints are no boolean array). Sent in
    binary: psycopg quotes each element of an array's text form in Python, 3× the CPU of a results call's 64
    documents (`bench pg_updates`)."""
    kinds = _pg_types(table, names)
    arrays = [list(values) for values in zip(*rows)]
    for i, kind in enumerate(kinds):
        if (as_type := _AS.get(kind)) is not None and set(map(type, arrays[i])) - {as_type, type(None)}:
            arrays[i] = [None if v is None else as_type(v) for v in arrays[i]]
    return "unnest(" + ", ".join(f"%b::{kind}[]" for kind in kinds) + ")", arrays


def raw(conn: Connection) -> Any:
    """The plain-statement connection under a SQLAlchemy connection: sqlite3's own, or psycopg's adapted."""
    driver = conn.connection.driver_connection
    return PgRaw(driver) if conn.dialect.name == POSTGRESQL else driver


def columns(conn: Connection, table: str) -> set[str]:
    """The columns `table` has (either database)."""
    if is_pg(conn):
        return {r[0] for r in conn.exec_driver_sql(
            "SELECT column_name FROM information_schema.columns WHERE table_schema = current_schema() "
            "AND table_name = %(t)s", {"t": table})}
    return {r[1] for r in conn.exec_driver_sql(f"PRAGMA table_info({table})")}


def index_columns(conn: Connection, index: str) -> list[str]:
    """The columns of an index, in order (empty when there is none)."""
    if is_pg(conn):
        return [r[0] for r in conn.exec_driver_sql(
            "SELECT a.attname FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
            "JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey) "
            "WHERE c.relname = %(i)s", {"i": index})]
    return [r[2] for r in conn.exec_driver_sql(f"PRAGMA index_info({index})")]
