"""The server's side of the wire: length-prefixed marshal requests in, JSON-line replies out.

Where it sits: `server.main.Server.serve_connection` reads requests with `read_frames` and
answers each with `reply_to` + `to_json`; the node's `rolloutd.sandbox.client.ExecClient` is the
other end. Requests are marshal (node → server: trusted, and marshal is builtin); replies are
JSON (server → node: a sandbox is untrusted, so the node parses them with json, never marshal).
"""
from __future__ import annotations

import marshal
from _json import encode_basestring_ascii as encode_string


class RequestError(Exception):
    """The request, not the sandbox, failed (no such file, a bad session name...): sent to the node
    as an error of type ``ExecError``, which `rolloutd.sandbox.ExecError` raises there."""


def read_frames(conn):
    """Requests: a 4-byte big-endian length, then a marshal payload (from the node,
    trusted; marshal is builtin, json would import re and enum)."""
    buf = bytearray()
    while True:
        while len(buf) >= 4:
            n = int.from_bytes(buf[:4], "big")
            if len(buf) < 4 + n:
                break
            payload = bytes(buf[4 : 4 + n])
            del buf[: 4 + n]
            try:
                yield marshal.loads(payload)
            except (ValueError, EOFError, TypeError):
                continue
        try:
            data = conn.recv(1 << 20)
        except OSError:
            return
        if not data:
            return
        buf += data


def to_json(obj) -> str:
    """Replies are JSON lines: the node parses what comes out of a sandbox with a
    safe parser (never marshal). Strings are escaped to ASCII, so a reply holds
    no raw newline; non-finite floats become null."""
    if obj is None:
        return "null"
    if obj is True:
        return "true"
    if obj is False:
        return "false"
    if isinstance(obj, str):
        return encode_string(obj)
    if isinstance(obj, int):
        return int.__repr__(obj)
    if isinstance(obj, float):
        return float.__repr__(obj) if obj == obj and obj not in (float("inf"), float("-inf")) else "null"
    if isinstance(obj, dict):
        return "{" + ",".join(encode_string(str(k)) + ":" + to_json(v) for k, v in obj.items()) + "}"
    if isinstance(obj, (list, tuple)):
        return "[" + ",".join(to_json(v) for v in obj) + "]"
    return encode_string(str(obj))


def reply_to(rid, call) -> dict:
    """The reply to request `rid`: what `call()` returns, or the error it raises —
    `RequestError` for the request's own failure (the node shows it to the agent),
    `ServerError` for anything else (the node treats it as infrastructure)."""
    try:
        return {"id": rid, "result": call()}
    except RequestError as e:
        return {"id": rid, "error": {"type": "ExecError", "message": str(e)}}
    except Exception as e:  # noqa: BLE001 - reported, the server keeps serving
        return {"id": rid, "error": {"type": "ServerError", "message": f"{type(e).__name__}: {e}"}}
