"""The web UI's JSON answers encoded by json's C encoder in the route's worker thread, never on the event loop.
Called by the /ui routes (`app.py`) that answer JSON growing with a job; the bytes go out as the route's Response.

FastAPI's generic encoder walks every value in Python on the loop: a 65 536-token trajectory's view held it 0.53 s
(`python -m bench answers`, bench/results/RESULTS-answers.md).
"""
from __future__ import annotations

import asyncio
import json
from typing import Any, Callable

from fastapi.responses import Response


def encoded(value: Any) -> bytes:
    """`value` as the JSON Starlette writes, by json's C encoder, in the route's worker thread: FastAPI's generic
    encoder walks every value in Python on the loop (a 65 536-token trajectory's view held it 0.53 s: bench answers)."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def with_raw(view: dict[str, Any], seq: int, stored: str) -> bytes:
    """The trajectory page's answer: `view` encoded, and under "raw" the stored JSON as it is, "seq" put first
    (encoding its token and logprob lists again took three quarters of the answer's time: bench answers)."""
    inner = stored.strip()[1:].lstrip()  # the stored object (pydantic's JSON of a Trajectory) after its "{"
    raw = f'{{"seq":{seq}{"" if inner.startswith("}") else ","}{inner}'
    head = encoded(view)[:-1]
    return head + (b',"raw":' if view else b'"raw":') + raw.encode() + b"}"


async def off_loop(make: Callable[[], Any]) -> Response:
    """`make()` and its JSON, both in a worker thread."""
    return json_response(await asyncio.to_thread(lambda: encoded(make())))


def json_response(body: bytes) -> Response:
    return Response(body, media_type="application/json")
