"""Request bodies and query values → Python data, with a 4xx for everything malformed.

Used by every route that reads a body (`api.py`, `http.nodes`, `http.trainer`). Beyond the parsers' own errors it
bounds what SQLite and the interpreter cannot take: nesting deeper than `MAX_DEPTH` (the parsers
recurse), integers outside SQLite's int64 and YAML aliases (refused: `_no_aliases`). Non-finite floats are the models' job
(`crds.base.Model` sets `allow_inf_nan=False`, so the 422 names the field).
"""
from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from typing import Any

import yaml
from fastapi import Request
from starlette.requests import ClientDisconnect
from pydantic import BaseModel, ValidationError

from rolloutd.crds.kit.documents import malformed_yaml, unreadable
from ..errors import BadRequest, Invalid, TooLarge, UnsupportedMediaType, from_validation_error

MAX_BODY_BYTES = 1 << 20  # 1 MiB: a RolloutJob is a few KB; datasets are referenced, not inlined
OFFLOAD_BYTES = 64 << 10
MAX_DEPTH = 64  # a RolloutJob nests ~6 deep; a trajectory's tool-call arguments a little more
MAX_VALUES = 1 << 20  # a 1 MiB JSON body holds fewer; YAML aliases ("billion laughs") could hold far more
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
BODY_TYPES = ("application/json", "application/yaml", "application/x-yaml", "text/yaml")
_DIGITS = re.compile(r"^[0-9]{1,19}$")


async def read_body(request: Request, limit: int = MAX_BODY_BYTES) -> bytes:
    declared = request.headers.get("content-length")
    if declared and _DIGITS.match(declared) and int(declared) > limit:
        raise TooLarge(f"request body is {declared} bytes; the limit is {limit}")
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise TooLarge(f"request body exceeds the limit of {limit} bytes")
    except ClientDisconnect:  # the client left, or the server closed a body late (`server._RequestDeadlines`)
        raise BadRequest("the request body did not arrive whole: the connection closed") from None
    return bytes(body)


async def parse_document(request: Request, limit: int = MAX_BODY_BYTES, *, walk: bool = True) -> dict[str, Any]:
    """YAML or JSON body → a mapping, with a 4xx naming the line for malformed input.
    No Content-Type: sniffed (JSON if it starts with `{`/`[`, else YAML); any other type is 415.
    `walk=False` skips `check_bounds` (the bulk trajectory reports: their models bound every integer
    field, and walking millions of token ids would stall the event loop)."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype and ctype not in BODY_TYPES:
        raise UnsupportedMediaType(f"content type {ctype!r} not supported; send application/json or application/yaml")
    return await _parse(await read_body(request, limit), ctype, walk)


async def _parse(raw: bytes, ctype: str, walk: bool) -> dict[str, Any]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRequest(f"request body is not UTF-8 text: {e}") from None
    json_ = ctype == "application/json" or text.lstrip()[:1] in ("{", "[")
    if len(raw) > OFFLOAD_BYTES:  # parsing (and walking) a large body takes long: not on the event loop
        return await asyncio.to_thread(_document, text, json_, walk)
    return _document(text, json_, walk)


def _document(text: str, json_: bool, walk: bool) -> dict[str, Any]:
    doc = parse_text(text, json_=json_)
    if not isinstance(doc, dict):
        raise BadRequest(f"expected an object, got {type(doc).__name__}")
    if walk:
        check_bounds(doc)
    return doc


_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's: 6-20× less CPU than the pure-Python one


def _no_aliases(text: str) -> None:
    """Refuse YAML aliases: a few hundred bytes of nested aliases ("billion laughs") expand to billions of values
    in whatever walks the document. One pass over the parser's events (libyaml's, in C) before anything is built:
    a bomb costs its first lines' events, a well-formed body one cheap pass."""
    events = _LOADER(text)
    try:
        while (event := events.get_event()) is not None:
            if isinstance(event, yaml.AliasEvent):
                line = event.start_mark.line + 1 if event.start_mark else "?"
                raise BadRequest(f"YAML aliases are not accepted in request bodies (*{event.anchor} at line {line}): "
                                 "write the value out, or send JSON", causes=[
                                     {"field": "body", "reason": "FieldValueForbidden", "message": "YAML alias"}])
    finally:
        events.dispose()


def parse_text(text: str, *, json_: bool) -> Any:
    try:
        if json_:  # JSON bodies (every machine client) take the fast parser; YAML is for people
            return _no_lone_surrogates(text, json.loads(text))
        _no_aliases(text)
        return _no_lone_surrogates(text, yaml.load(text, Loader=_LOADER))  # noqa: S506 - a SafeLoader
    except RecursionError:
        raise BadRequest(f"request body nests too deeply (the limit is {MAX_DEPTH} levels)") from None
    except json.JSONDecodeError as e:
        raise BadRequest(f"malformed JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None
    except yaml.YAMLError as e:
        raise BadRequest(malformed_yaml(e, "YAML/JSON")) from None
    except ValueError as e:  # an integer of more digits than Python converts (4300), a YAML date such as 2026-02-30:
        # a 500 at every retry before
        raise BadRequest(f"request body: {unreadable(e)}") from None


# an escape of a UTF-16 surrogate: a pair is one character, but one alone parses to a string that is not Unicode text,
# which neither store, nor JSON out, can take (a results call holding one failed at every retry: its job stalled)
_SURROGATE = re.compile(r"\\(u|U0000)[dD][89a-fA-F][0-9a-fA-F]{2}")


def _no_lone_surrogates(text: str, doc: Any) -> Any:
    """`doc`, or a 400 naming where it holds a lone surrogate (looked for only when `text` has a surrogate's escape)."""
    if not _SURROGATE.search(text):
        return doc
    for node, path, _ in _walk(doc, keys=True):
        if isinstance(node, str):
            try:
                node.encode("utf-8")
            except UnicodeEncodeError:
                where = path or "<root>"
                raise BadRequest(f"request body holds a lone UTF-16 surrogate (an escape such as \\ud800 without its "
                                 f"pair), which is not Unicode text, at {where}",
                                 causes=[{"field": where, "reason": "FieldValueInvalid",
                                          "message": "a lone UTF-16 surrogate"}]) from None
    return doc


async def read_model(request: Request, model: type[BaseModel], limit: int | None = None) -> Any:
    """The body validated as `model` (422 naming each field). A `limit` above the default marks a bulk
    report: its model bounds every integer, so `check_bounds` is skipped (see `parse_document`)."""
    doc = await parse_document(request, limit or MAX_BODY_BYTES, walk=limit is None)
    try:
        return model.model_validate(doc)
    except ValidationError as e:
        raise from_validation_error(e, root=model) from None


async def read_model_fast(request: Request, model: type[BaseModel], limit: int = MAX_BODY_BYTES) -> Any:
    """`read_model` for the node protocol's frequent calls: a JSON body validated straight from its bytes
    (pydantic's parser, no Python dict in between: the dict and its walk were most of a beat's parsing).
    Only for models that bound every value themselves (`check_bounds` is not run); whatever the fast path
    refuses goes through `read_model`, so a bad body gets the same error as before."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != "application/json":
        return await read_model(request, model, limit)
    raw = await read_body(request, limit)
    try:
        if len(raw) > OFFLOAD_BYTES:
            return await asyncio.to_thread(model.model_validate_json, raw)
        return model.model_validate_json(raw)
    except ValidationError:
        pass
    doc = await _parse(raw, ctype, walk=limit == MAX_BODY_BYTES)
    try:
        return model.model_validate(doc)
    except ValidationError as e:
        raise from_validation_error(e, root=model) from None


def check_bounds(doc: Any) -> None:
    """Iteratively: depth ≤ MAX_DEPTH, at most MAX_VALUES values, every integer within int64
    (else 400/422 naming the field)."""
    for seen, (node, path, depth) in enumerate(_walk(doc), 1):
        if seen > MAX_VALUES:
            raise TooLarge(f"request body holds more than {MAX_VALUES} values (YAML aliases count once per use)")
        if depth > MAX_DEPTH:
            raise BadRequest(f"request body nests too deeply at {path or '<root>'} (the limit is {MAX_DEPTH} levels)")
        if isinstance(node, int) and not isinstance(node, bool) and not INT64_MIN <= node <= INT64_MAX:
            message = f"integer out of range (the limit is ±2^63): {str(node)[:30]}…"
            raise Invalid(f"request is invalid: {path}: {message}",
                          causes=[{"field": path, "reason": "FieldValueInvalid", "message": message}])


def _walk(doc: Any, *, keys: bool = False) -> Iterator[tuple[Any, str, int]]:
    """Every value in `doc` with its path (`a.b[2]`) and depth, iteratively; each string key too when `keys`. A
    value's children are reached only after it is yielded, so a consumer raising at a value walks no further."""
    stack: list[tuple[Any, str, int]] = [(doc, "", 0)]
    while stack:
        node, path, depth = stack.pop()
        yield node, path, depth
        if isinstance(node, dict):
            stack.extend((v, f"{path}.{k}" if path else str(k), depth + 1) for k, v in node.items())
            if keys:
                stack.extend((k, f"{path or '<root>'}: a key", depth + 1) for k in node if isinstance(k, str))
        elif isinstance(node, list):
            stack.extend((v, f"{path}[{i}]", depth + 1) for i, v in enumerate(node))


def parse_version(value: Any, field: str) -> int | None:
    """A resourceVersion as sent (string or int; None/absent: no check) → int, or 400."""
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= INT64_MAX:
        return value
    if isinstance(value, str) and _DIGITS.match(value) and int(value) <= INT64_MAX:
        return int(value)
    message = f"must be a resourceVersion (a decimal integer as a string), got {str(value)[:40]!r}"
    raise BadRequest(f"{field} {message}", causes=[{"field": field, "reason": "FieldValueInvalid", "message": message}])
