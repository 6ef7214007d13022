"""The one shape every harness dialect has (`Dialect`), and the table of dialects the gateway serves (`DIALECTS`).

A dialect is a module of agents/wire/ (chat.py, anthropic.py, responses.py) with `parse`, `reply`, `error` and
`Events`; it registers by one line in `DIALECTS` (its request path). Used by agents/gateway/server.py, which routes each
path in the table through `Gateway._dialect`; tests/agents/test_wire_dialects.py checks every entry against the
protocol, signature by signature. Writing one: docs/content/write-a-dialect.md.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

from . import Prompt, Turn, anthropic, chat, responses


class Events(Protocol):
    """The bytes of one streamed answer: `start()` once the engine took the call, `text(delta)` per safe text
    delta, `end(turn, rest)` with the tool calls and the finish, or `failed(message)` when the engine fails."""

    def __init__(self, model: str, prompt_tokens: int, body: dict | None = None) -> None: ...

    def start(self) -> bytes: ...

    def text(self, delta: str) -> bytes: ...

    def end(self, turn: Turn, rest: str) -> bytes: ...

    def failed(self, message: str) -> bytes: ...


@runtime_checkable
class Dialect(Protocol):
    """A harness's API: its request body → a `Prompt`; a finished `Turn` → its JSON; an error in its shape;
    `Events`, its stream (a class taking `(model, prompt_tokens, body)`)."""

    Events: type[Events]

    def parse(self, body: dict) -> Prompt: ...

    def reply(self, turn: Turn, model: str, body: dict | None = None) -> dict: ...

    def error(self, status: int, message: str, kind: str) -> dict: ...


# The dialects the gateway serves, by request path (POST). One line registers a new one.
DIALECTS: dict[str, Dialect] = {
    "/v1/chat/completions": chat,
    "/v1/messages": anthropic,
    "/v1/responses": responses,
}

__all__ = ["DIALECTS", "Dialect", "Events"]
