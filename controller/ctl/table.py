"""The job table `rolloutctl get` prints (kubectl's layout of the CRD's printer columns), in plain text without
rich, so that `get`'s fast path (`fast.py`) and the full CLI (`views.py`) print the same table cheaply."""
from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from rolloutd.crds.columns import PRINTER_COLUMNS


def counts(obj: dict[str, Any]) -> dict[str, int]:
    return obj.get("status", {}).get("counts", {}) or {}


def age(ts: str | None) -> str:
    if not ts:
        return "-"
    then = datetime.strptime(ts, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)
    s = int((datetime.now(timezone.utc) - then).total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{s // size}{unit}"
    return f"{max(s, 0)}s"


def cell(obj: dict[str, Any], column: dict[str, Any]) -> str:
    """A printer column's value in `obj` (its jsonPath), as text; a date column as an age."""
    cur: Any = obj
    for part in column["jsonPath"].lstrip(".").split("."):
        cur = cur.get(part) if isinstance(cur, dict) else None
    if column["type"] == "date":
        return age(cur)
    if cur is None or cur == "":
        return "0" if column["type"] == "integer" else "-"
    return f"{cur:.3g}" if column["type"] == "number" else str(cur)


def jobs_table(items: list[dict[str, Any]], wide: bool, namespaces: bool = False) -> str:
    """The CRD's printer columns (`crds.crd.PRINTER_COLUMNS`): what `kubectl get` prints, same names and values,
    laid out as kubectl does (each column as wide as its widest cell, three spaces apart): never cut to fit a
    terminal, whose lines wrap instead (a rich table shrank NAME to nothing on a narrow one)."""
    columns = [c for c in PRINTER_COLUMNS if wide or not c.get("priority")]
    ns = ["NAMESPACE"] if namespaces else []  # `get -A`: kubectl's first column
    rows = [[*ns, "NAME", *(c["name"].upper() for c in columns)]]
    rows += [[*([o["metadata"].get("namespace", "default")] if namespaces else []), o["metadata"]["name"],
              *(cell(o, c) for c in columns)] for o in items]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("   ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows)
