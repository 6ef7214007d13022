"""A scripted controller for the client's unit tests: an `httpx.MockTransport` handler that
records every request and answers from per-route scripts. Works for the sync and the async
client alike (streams implement both byte-stream protocols)."""
from __future__ import annotations

import json
from collections import defaultdict
from typing import Any, Callable

import httpx

P = "/apis/rolloutd.io/v1alpha1/rolloutjobs"  # the cluster-wide list and watch
J = "/apis/rolloutd.io/v1alpha1/namespaces/default/rolloutjobs"  # a job of the client's namespace


class Stream(httpx.SyncByteStream, httpx.AsyncByteStream):
    """Body chunks, then optionally a transport error (a connection dropped mid-stream)."""

    def __init__(self, chunks: list[bytes], error: Exception | None = None):
        self.chunks, self.error = chunks, error

    def __iter__(self):
        yield from self.chunks
        if self.error:
            raise self.error

    async def __aiter__(self):
        for c in self.chunks:
            yield c
        if self.error:
            raise self.error


def status(code: int, reason: str, message: str, causes: list[dict] | None = None) -> httpx.Response:
    details: dict[str, Any] = {"kind": "rolloutjobs"}
    if causes:
        details["causes"] = causes
    return httpx.Response(code, json={"apiVersion": "v1", "kind": "Status", "status": "Failure", "message": message,
                                      "reason": reason, "code": code, "details": details})


def traj(seq: int, prompt: int = 0, sample: int = 0, reward: float | None = 1.0, **kw) -> dict[str, Any]:
    t = {"seq": seq, "job": "j", "prompt": prompt, "sample": sample, "reward": reward,
         "failure": {"kind": "none" if reward is not None else "infra", "reason": ""},
         "tokenIds": [1, 2, 3], "promptLength": 2, "lossMask": [0, 0, 1], "logprobs": [None, None, -0.5]}
    t.update(kw)
    return t


def ndjson(rows: list[dict]) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)


class FakeController:
    """`routes[(METHOD, path)]` is a list of answers consumed in order (the last one repeats);
    an answer is an httpx.Response or a callable(request) -> Response."""

    def __init__(self) -> None:
        self.routes: dict[tuple[str, str], list[Any]] = defaultdict(list)
        self.requests: list[httpx.Request] = []

    def on(self, method: str, path: str, *answers: Any) -> "FakeController":
        self.routes[(method, path if path.startswith("/") else f"{J}/{path}")].extend(answers)
        return self

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        key = (request.method, request.url.path)
        script = self.routes.get(key)
        if not script:
            return status(404, "NotFound", f"no route {key}")
        answer = script.pop(0) if len(script) > 1 else script[0]
        if isinstance(answer, Exception):
            raise answer
        return answer(request) if callable(answer) else answer

    def calls(self, method: str, path: str) -> list[httpx.Request]:
        path = path if path.startswith("/") else f"{J}/{path}"
        return [r for r in self.requests if r.method == method and r.url.path == path]


def transport(handler: Callable) -> httpx.MockTransport:
    return httpx.MockTransport(handler)


class Ticks:
    """A clock for the retry budget that moves 0.1 s at each look: the count of tries is the budget's, not the
    box's load (a wall clock on a busy CI box let a 0.3 s budget end after two tries)."""

    def __init__(self):
        self.now = 0.0

    def monotonic(self) -> float:
        self.now += 0.1
        return self.now
