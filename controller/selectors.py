"""Label and field selectors as Kubernetes parses them (`?labelSelector=`, `?fieldSelector=`).

Used by the store's list and watch and by the core/v1 Events list. Next step: `selectableFields`
beyond metadata.name/namespace if a client needs them.
"""
from __future__ import annotations

import re
from typing import Any

from rolloutd.crds.k8s_names import valid_label_key, valid_label_value

from .errors import BadRequest

Term = tuple[str, str, Any]  # (key, op, value); op: = != exists !exists in notin
_EQUALITY = re.compile(r"^\s*(?P<neg>!)?\s*(?P<key>[^!=\s()]+)\s*(?:(?P<op>==|!=|=)\s*(?P<value>[^!=\s]*))?\s*$")
_SET = re.compile(r"^\s*(?P<key>[^!=\s()]+)\s+(?P<op>in|notin)\s*\((?P<values>[^()]*)\)\s*$")


def _split_terms(selector: str) -> list[str]:
    """Commas separate terms except inside `in (a,b)`."""
    terms, depth, cur = [], 0, ""
    for ch in selector:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            terms.append(cur)
            cur = ""
        else:
            cur += ch
    terms.append(cur)
    return [t.strip() for t in terms if t.strip()]


def _bad(param: str, term: str, why: str) -> BadRequest:
    return BadRequest(f"invalid {param} term {term[:100]!r}: {why}",
                      causes=[{"field": param, "reason": "FieldValueInvalid", "message": why}])


def parse_selector(selector: str | None) -> list[Term]:
    """`a=b,c!=d,e,!f,g in (x,y),h notin (z)` → terms. 400 naming the term and why for anything else."""
    out: list[Term] = []
    for term in _split_terms(selector or ""):
        s = _SET.match(term)
        if s:
            values = [v.strip() for v in s["values"].split(",") if v.strip()]
            bad = next((v for v in values if not valid_label_value(v)), None)
            if not valid_label_key(s["key"]) or bad is not None or not values:
                raise _bad("labelSelector", term, "expected KEY in (V1,V2) with a valid key and values")
            out.append((s["key"], s["op"], set(values)))
            continue
        m = _EQUALITY.match(term)
        why = None
        if m is None or (m["neg"] and m["op"]):
            why = "expected KEY, !KEY, KEY=VALUE, KEY==VALUE, KEY!=VALUE, KEY in (…) or KEY notin (…)"
        elif not valid_label_key(m["key"]):
            why = f"{m['key']!r} is not a valid label key"
        elif m["op"] and not valid_label_value(m["value"]):
            why = f"{m['value']!r} is not a valid label value (≤63 chars of [A-Za-z0-9-_.])"
        if why:
            raise _bad("labelSelector", term, why)
        if m["op"]:
            out.append((m["key"], "=" if m["op"] == "==" else m["op"], m["value"]))
        else:
            out.append((m["key"], "!exists" if m["neg"] else "exists", None))
    return out


def matches(labels: dict[str, str], selector: list[Term]) -> bool:
    for key, op, value in selector:
        have = labels.get(key)
        if op == "exists":
            ok = key in labels
        elif op == "!exists":
            ok = key not in labels
        elif op in ("in", "notin"):
            ok = (have in value) == (op == "in")
        else:
            ok = (have == value) == (op == "=")
        if not ok:
            return False
    return True


def parse_field_selector(selector: str | None, fields: tuple[str, ...]) -> list[Term]:
    """`metadata.name=x,metadata.namespace!=y` over the allowed `fields`; 400 for any other field."""
    out: list[Term] = []
    for term in _split_terms(selector or ""):
        m = re.match(r"^\s*(?P<key>[A-Za-z.]+)\s*(?P<op>==|!=|=)\s*(?P<value>[^,]*?)\s*$", term)
        if m is None:
            raise _bad("fieldSelector", term, "expected FIELD=VALUE, FIELD==VALUE or FIELD!=VALUE")
        if m["key"] not in fields:
            raise _bad("fieldSelector", term, f"field {m['key']!r} is not supported; supported: {', '.join(fields)}")
        out.append((m["key"], "=" if m["op"] == "==" else m["op"], m["value"]))
    return out


def field_value(obj: dict[str, Any], path: str) -> Any:
    cur: Any = obj
    for part in path.split("."):
        cur = cur.get(part) if isinstance(cur, dict) else None
    return cur


def fields_match(obj: dict[str, Any], selector: list[Term]) -> bool:
    return all((str(field_value(obj, k) or "") == v) == (op == "=") for k, op, v in selector)
