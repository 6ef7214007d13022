"""The example of docs/content/write-a-dialect.md: a harness dialect in one file (in the product it sits in
agents/wire/ and registers by one line of `DIALECTS`, agents/wire/dialect.py).

`POST {"prompt": "...", "max_tokens": n, "stream": bool}` → `{"text": ..., "finish": ...}`; streamed, one line of
JSON per text delta. Checked against the `Dialect` protocol by tests/test_write_your_own.py.
"""
from __future__ import annotations

import json

from rolloutd.agents.wire import Invalid, Prompt, Turn, flag
from rolloutd.agents.wire.openai import max_tokens


def parse(body: dict) -> Prompt:
    if not isinstance(body.get("prompt"), str):
        raise Invalid("prompt: a string")
    return Prompt([{"role": "user", "content": body["prompt"]}], None, max_tokens(body.get("max_tokens")),
                  stream=flag(body.get("stream"), "stream"))


def reply(turn: Turn, model: str, body: dict | None = None) -> dict:
    return {"model": model, "text": turn.text, "finish": turn.finish,
            "tokens": {"prompt": turn.prompt_tokens, "completion": turn.completion_tokens}}


def error(status: int, message: str, kind: str) -> dict:
    return {"error": message, "kind": kind, "status": status}


class Events:
    """One JSON line per text delta, then the whole answer's line."""

    def __init__(self, model: str, prompt_tokens: int, body: dict | None = None) -> None:
        self.model = model

    def start(self) -> bytes:
        return b""

    def text(self, delta: str) -> bytes:
        return (json.dumps({"delta": delta}) + "\n").encode() if delta else b""

    def end(self, turn: Turn, rest: str) -> bytes:
        return self.text(rest) + (json.dumps(reply(turn, self.model)) + "\n").encode()

    def failed(self, message: str) -> bytes:
        return (json.dumps(error(502, f"backend: {message}", "backend_error")) + "\n").encode()
