"""PostgreSQL's text cannot hold a NUL character, and SQLite's can: every string a PostgreSQL connection of the store
sends has its NULs replaced by U+FFFD (the Unicode replacement character), so text that a node or a client sent is
stored rather than refused at every retry (a results call that failed so stalled its job) or answered 500 (a name
with %00 in a URL). Documents are JSON, which escapes a NUL: a trajectory keeps its text exactly; a column copied
out of it (a failure's reason, a task id) shows U+FFFD. Next step: `db.StoreDB` installs it on each connection.
"""
from __future__ import annotations

from functools import cache
from typing import Any

REPLACEMENT = "\ufffd"


def _nul_free(base: type) -> type:
    class NulFree(base):  # type: ignore[misc, valid-type]
        def dump(self, obj: str) -> Any:
            return super().dump(obj.replace("\x00", REPLACEMENT) if "\x00" in obj else obj)
    NulFree.__name__ = NulFree.__qualname__ = f"NulFree{base.__name__}"
    return NulFree


@cache
def dumpers() -> tuple[type, ...]:
    """In psycopg's own order (`string.register_default_adapters`): the last of each format is its default for a str,
    the others are found by the type a statement or an array names. psycopg is imported here, not at the top: it is
    the [postgresql] extra, which a controller on SQLite does without."""
    from psycopg.types import string

    return tuple(_nul_free(c) for c in (string.StrBinaryDumperName, string.StrBinaryDumperVarchar,
                                         string.StrBinaryDumper, string.StrDumperName, string.StrDumperVarchar,
                                         string.StrDumper, string.StrDumperUnknown))


def install(connection: Any) -> None:
    """On one psycopg connection (its own adapters: the process's other connections are left as they are)."""
    for dumper in dumpers():
        connection.adapters.register_dumper(str, dumper)
