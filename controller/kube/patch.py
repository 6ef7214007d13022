"""PATCH bodies applied to a RolloutJob: JSON merge patch, JSON patch, and server-side apply with managedFields.

Called by the PATCH routes (`rolloutjobs.py`) on the stored object's wire form; the result is validated
like any update. Server-side apply tracks, per field manager, the leaf fields it set (lists are
atomic, as in RolloutJob's schema); a value another manager owns differently is a 409 conflict
unless `force=true`. Next step: list-map keys if the schema ever gains `x-kubernetes-list-type: map`.
"""
from __future__ import annotations

import copy
from datetime import datetime, timezone
from typing import Any, Callable

import jsonpatch

from ..errors import ApiError, BadRequest, UnsupportedMediaType

MERGE, JSON_PATCH, APPLY = ("application/merge-patch+json", "application/json-patch+json",
                            "application/apply-patch+yaml")
PATCH_TYPES = (MERGE, JSON_PATCH, APPLY)
_IDENTITY = {("apiVersion",), ("kind",), ("metadata", "name"), ("metadata", "namespace")}
_SERVER_META = ("uid", "resourceVersion", "generation", "creationTimestamp", "deletionTimestamp",
                "deletionGracePeriodSeconds", "managedFields")

Path = tuple[str, ...]


class ApplyConflict(ApiError):
    code, reason = 409, "Conflict"


def patch_type(content_type: str | None) -> str:
    ctype = (content_type or "").split(";")[0].strip().lower()
    if ctype not in PATCH_TYPES:
        raise UnsupportedMediaType(
            f"the body of the request was in an unknown format {ctype!r} - accepted media types include: "
            + ", ".join(PATCH_TYPES))
    return ctype


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def json_patch(target: dict[str, Any], ops: Any) -> dict[str, Any]:
    """RFC 6902 through `jsonpatch`; a malformed or failing operation is a 422 naming it."""
    if not isinstance(ops, list):
        raise BadRequest("a JSON patch must be a list of operations")
    try:
        return jsonpatch.JsonPatch(ops).apply(target)
    except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException, TypeError, KeyError) as e:
        from ..errors import Invalid
        raise Invalid(f"the JSON patch could not be applied: {e}",
                      causes=[{"field": "patch", "reason": "FieldValueInvalid", "message": str(e)}]) from None


# ---------------------------------------------------------------- server-side apply


def leaves(obj: Any, prefix: Path = ()) -> dict[Path, Any]:
    """Leaf paths of a document; lists and empty maps are leaves (atomic)."""
    if isinstance(obj, dict) and obj:
        out: dict[Path, Any] = {}
        for k, v in obj.items():
            out.update(leaves(v, prefix + (k,)))
        return out
    return {prefix: obj}


def _get(obj: Any, path: Path) -> Any:
    for p in path:
        if not isinstance(obj, dict) or p not in obj:
            return _MISSING
        obj = obj[p]
    return obj


def _remove(obj: dict[str, Any], path: Path) -> None:
    parents = []
    cur: Any = obj
    for p in path[:-1]:
        if not isinstance(cur, dict) or p not in cur:
            return
        parents.append((cur, p))
        cur = cur[p]
    if isinstance(cur, dict):
        cur.pop(path[-1], None)
    for parent, key in reversed(parents):  # prune maps left empty
        if parent[key] == {}:
            del parent[key]


_MISSING = object()


def fields_v1(paths: set[Path]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for path in sorted(paths):
        cur = out
        for p in path:
            cur = cur.setdefault(f"f:{p}", {})
    return out


def paths_of(fields: dict[str, Any], prefix: Path = ()) -> set[Path]:
    out: set[Path] = set()
    for key, sub in fields.items():
        if not key.startswith("f:"):
            continue
        path = prefix + (key[2:],)
        out |= paths_of(sub, path) if sub else {path}
    return out


def _owned(obj: dict[str, Any]) -> list[dict[str, Any]]:
    return [dict(e) for e in obj.get("metadata", {}).get("managedFields", []) if isinstance(e, dict)]


def _entry(manager: str, operation: str, api_version: str, paths: set[Path], subresource: str) -> dict[str, Any]:
    entry = {"manager": manager, "operation": operation, "apiVersion": api_version,
             "time": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "fieldsType": "FieldsV1",
             "fieldsV1": fields_v1(paths)}
    if subresource:
        entry["subresource"] = subresource
    return entry


def _tracked(doc: dict[str, Any], subresource: str) -> dict[Path, Any]:
    if subresource == "status":
        return {p: v for p, v in leaves({"status": doc.get("status", {})}).items()}
    view = {k: v for k, v in doc.items() if k != "status"}
    view["metadata"] = {k: v for k, v in doc.get("metadata", {}).items() if k not in _SERVER_META}
    return {p: v for p, v in leaves(view).items() if p not in _IDENTITY}


def record_update(before: dict[str, Any], after: dict[str, Any], manager: str, subresource: str = "") -> list:
    """managedFields after a non-apply write: `manager` takes the fields whose values it changed."""
    old, new = _tracked(before, subresource), _tracked(after, subresource)
    changed = {p for p in set(old) | set(new) if old.get(p, _MISSING) != new.get(p, _MISSING) and p in new}
    entries = _owned(before)
    if not changed:
        return entries
    out, mine = [], set(changed)
    for e in entries:
        paths = paths_of(e.get("fieldsV1", {}))
        if e["manager"] == manager and e["operation"] == "Update" and e.get("subresource", "") == subresource:
            mine |= {p for p in paths if p in new}
            continue
        left = {p for p in paths if p not in changed}
        if left:
            out.append({**e, "fieldsV1": fields_v1(left)})
    return out + [_entry(manager, "Update", after.get("apiVersion", ""), mine, subresource)]


def server_side_apply(current: dict[str, Any] | None, applied: dict[str, Any], manager: str, force: bool,
                      subresource: str = "", normalize: Callable[[dict[str, Any]], dict[str, Any]] = lambda d: d
                      ) -> dict[str, Any]:
    """The object after `manager` applies `applied` (its full intent) to `current` (None: create).
    `normalize` validates and defaults a candidate; a conflict is a field another manager owns whose
    value the apply would change once defaulted (so re-stating a defaulted value is no conflict)."""
    current = copy.deepcopy(current) if current is not None else {
        "apiVersion": applied.get("apiVersion"), "kind": applied.get("kind"), "metadata": {}}
    want = _tracked(applied, subresource)
    entries = _owned(current)
    previously: set[Path] = set()
    for e in entries:
        if e["manager"] == manager and e["operation"] == "Apply" and e.get("subresource", "") == subresource:
            previously = paths_of(e.get("fieldsV1", {}))
    others_before = [e for e in entries if not (e["manager"] == manager and e["operation"] == "Apply"
                                                and e.get("subresource", "") == subresource)]
    owned_by_others = set().union(*(paths_of(e.get("fieldsV1", {})) for e in others_before)) \
        if others_before else set()
    result = copy.deepcopy(current)
    for p in previously - set(want) - owned_by_others:  # dropped from the intent and owned by nobody else
        _remove(result, p)
    for p, v in want.items():
        _set(result, p, copy.deepcopy(v))
    result = normalize(result)
    changed = {p for p in want if _get(current, p) != _get(result, p)}
    conflicts = [(e["manager"], p) for e in others_before for p in sorted(paths_of(e.get("fieldsV1", {})) & changed)]
    if conflicts and not force:
        causes = [{"field": ".".join(p), "reason": "FieldManagerConflict",
                   "message": f'conflict with "{m}"'} for m, p in conflicts]
        raise ApplyConflict(
            "Apply failed with %d conflict%s: %s" % (len(conflicts), "s" if len(conflicts) > 1 else "",
                                                     "; ".join(f'conflict with "{m}": .{".".join(p)}'
                                                               for m, p in conflicts))
            + " (re-apply with force=true to take them over)", causes=causes)
    out = []
    for e in others_before:
        paths = paths_of(e.get("fieldsV1", {})) - changed  # forced: the others lose what changed under them
        if paths:
            out.append({**e, "fieldsV1": fields_v1(paths)})
    result.setdefault("metadata", {})["managedFields"] = out + [
        _entry(manager, "Apply", applied.get("apiVersion", ""), set(want), subresource)]
    return result


def _set(obj: dict[str, Any], path: Path, value: Any) -> None:
    for p in path[:-1]:
        if not isinstance(obj.get(p), dict):
            obj[p] = {}
        obj = obj[p]
    obj[path[-1]] = value
