"""`kubectl get` output: RolloutJobs as a meta.k8s.io/v1 Table built from the CRD's additionalPrinterColumns.

Used by the get/list/watch routes when the client's Accept asks for `as=Table`. The columns come
from `crds/crd.py`, so a real cluster and the embedded controller print the same table.
"""
from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from rolloutd.crds.crd import build_crd

_COLUMNS = build_crd()["spec"]["versions"][0]["additionalPrinterColumns"]


def wants_table(accept: str | None) -> bool:
    return bool(accept) and "as=Table" in accept


def _age(stamp: str | None) -> str:
    if not stamp:
        return "<unknown>"
    seconds = int((datetime.now(timezone.utc) - datetime.fromisoformat(stamp.replace("Z", "+00:00"))).total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= 2 * size:
            return f"{seconds // size}{unit}"
    return f"{max(seconds, 0)}s"


def _cell(obj: dict[str, Any], column: dict[str, Any]) -> Any:
    cur: Any = obj
    for part in column["jsonPath"].lstrip(".").split("."):
        cur = cur.get(part) if isinstance(cur, dict) else None
    if column["type"] == "date":
        return _age(cur)
    return cur


def row(obj: dict[str, Any], include_object: str = "Metadata") -> dict[str, Any]:
    if include_object == "None":
        embedded = None
    elif include_object == "Object":
        embedded = obj
    else:
        embedded = {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": obj["metadata"]}
    return {"cells": [obj["metadata"]["name"], *(_cell(obj, c) for c in _COLUMNS)], "object": embedded}


def table(objects: list[dict[str, Any]], resource_version: str | None = None, cont: str | None = None,
          include_object: str = "Metadata") -> dict[str, Any]:
    meta: dict[str, Any] = {}
    if resource_version is not None:
        meta["resourceVersion"] = resource_version
    if cont:
        meta["continue"] = cont
    columns = [{"name": "Name", "type": "string", "format": "name", "priority": 0,
                "description": "Name must be unique within a namespace."}]
    columns += [{"name": c["name"], "type": "string" if c["type"] == "date" else c["type"], "format": "",
                 "priority": c.get("priority", 0), "description": c.get("description", c["jsonPath"])}
                for c in _COLUMNS]
    return {"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": meta, "columnDefinitions": columns,
            "rows": [row(o, include_object) for o in objects]}
