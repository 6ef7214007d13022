"""OpenAI chat completions (`POST /v1/chat/completions`) ↔ the gateway's `Prompt` / `Turn` / text deltas.

Streaming: a first chunk with the role, one chunk per text delta, the tool calls (whole, each with its index)
after the text, a last chunk with `finish_reason` and usage, then `data: [DONE]`. Used by agents/gateway/server.py;
next step: the gateway renders the prompt and calls the engine.
"""
from __future__ import annotations

import time
from typing import Any

from .openai import chat_messages, chat_tools, max_tokens
from . import Invalid, Prompt, Turn, flag, new_id, sse, string_list

FINISH = {"stop": "stop", "stop_sequence": "stop", "length": "length", "tool_calls": "tool_calls"}


def parse(body: dict) -> Prompt:
    choice = body.get("tool_choice")
    if choice is not None and not isinstance(choice, (str, dict)):
        raise Invalid("tool_choice: a string or an object")
    return Prompt(chat_messages(body), chat_tools(body),
                  max_tokens(body.get("max_completion_tokens") or body.get("max_tokens")),
                  string_list(body.get("stop"), "stop", 4), flag(body.get("stream"), "stream"), choice != "none")


def error(status: int, message: str, kind: str) -> dict:
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


def _tool_calls(turn: Turn) -> list[dict]:
    return [{"index": i, "id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for i, c in enumerate(turn.tool_calls)]


def _usage(turn: Turn) -> dict:
    return {"prompt_tokens": turn.prompt_tokens, "completion_tokens": turn.completion_tokens,
            "total_tokens": turn.prompt_tokens + turn.completion_tokens}


def reply(turn: Turn, model: str, body: dict | None = None) -> dict:
    calls = [{k: v for k, v in c.items() if k != "index"} for c in _tool_calls(turn)]
    message = {"role": "assistant", "content": turn.text if turn.text or not calls else None,
               **({"tool_calls": calls} if calls else {})}
    return {"id": new_id("chatcmpl-"), "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": FINISH[turn.finish]}], "usage": _usage(turn)}


class Events:
    """The chunks of one streamed answer, as bytes."""

    def __init__(self, model: str, prompt_tokens: int, body: dict | None = None) -> None:
        self.head = {"id": new_id("chatcmpl-"), "object": "chat.completion.chunk", "created": int(time.time()),
                     "model": model}

    def _chunk(self, delta: dict, finish: str | None = None, **extra: Any) -> bytes:
        return sse(None, {**self.head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra})

    def start(self) -> bytes:
        return self._chunk({"role": "assistant", "content": ""})

    def text(self, delta: str) -> bytes:
        return self._chunk({"content": delta}) if delta else b""

    def end(self, turn: Turn, rest: str) -> bytes:
        out = self.text(rest)
        if turn.tool_calls:
            out += self._chunk({"tool_calls": _tool_calls(turn)})
        return out + self._chunk({}, FINISH[turn.finish], usage=_usage(turn)) + b"data: [DONE]\n\n"

    def failed(self, message: str) -> bytes:
        return sse(None, error(502, f"backend: {message}", "backend_error")) + b"data: [DONE]\n\n"
