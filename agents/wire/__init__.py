"""The dialects of the harness gateway, translated to ONE internal request and from ONE internal result.

Each dialect (chat.py: OpenAI chat completions, anthropic.py: Anthropic Messages, responses.py: OpenAI
Responses) turns its request body into a `Prompt` (messages in the chat template's shape, tools in OpenAI
function shape, limits) and a finished `Turn` (text, tool calls, finish, usage) or a stream of text deltas into
its own JSON or server-sent events; every dialect exposes `parse`, `reply`, `error` and `Events`.
`TextDeltas` turns the engine's token ids, as they come, into the text deltas safe to send now.

Used by agents/gateway/server.py. Next step: the gateway renders `Prompt.messages` with the model's chat template,
calls the engine token-in/token-out and records the ids (agents/gateway/calls.py).
"""
from __future__ import annotations

import json
import uuid
from functools import partial
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

from .openai import Invalid, parse_tool_calls
from ..toolcall_formats import FORMATS, format_for


@dataclass
class Prompt:
    """One request in the gateway's own terms."""

    messages: list[dict]
    tools: list[dict] | None = None
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    parse_tools: bool = True  # False when the harness said tool_choice "none"


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of an object
    input: dict


@dataclass
class Turn:
    """One finished answer. `finish`: stop, length, tool_calls or stop_sequence."""

    text: str
    tool_calls: list[ToolCall]
    finish: str
    prompt_tokens: int
    completion_tokens: int
    stop_sequence: str | None = None


class ToolParser(NamedTuple):
    """How a model family writes tool calls: `split(text) -> (content, OpenAI tool_calls)`, and the texts a
    call may start with (`openers`: streamed text is held back from where one may begin)."""

    split: Callable[[str], tuple[str | None, list[dict]]]
    openers: tuple[str, ...]


def tool_call_parser(tokenizer: Any) -> ToolParser:
    """THE choice of tool-call format for a model (one call site: the gateway's init): the family's format read
    from its chat template (agents/toolcall_formats.py: Hermes/Qwen, Llama 3 JSON, Mistral)."""
    fmt = format_for(tokenizer) if tokenizer is not None else FORMATS["hermes"]
    return ToolParser(partial(parse_tool_calls, fmt=fmt), fmt.openers)


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def make_turn(text: str, prompt: Prompt, parser: ToolParser, *, finish_reason: str, stop_reason: Any,
              prompt_tokens: int, completion_tokens: int) -> Turn:
    """The engine's decoded text → a `Turn`: cut at a harness stop sequence, tool calls split out (a call whose
    arguments are not a JSON object leaves the whole answer as text, as the real APIs return a malformed call)."""
    stop = next((s for s in prompt.stop if s in text), None) if prompt.stop else None
    if stop is not None:
        text = text[: text.index(stop)]
    calls: list[ToolCall] = []
    if prompt.tools and prompt.parse_tools:
        content, raw = parser.split(text)
        for call in raw:
            function = call.get("function") or {}
            try:
                arguments = json.loads(function.get("arguments") or "{}")
            except (TypeError, ValueError, RecursionError):  # what the model wrote: any text at all
                arguments = None
            if not isinstance(arguments, dict) or not isinstance(function.get("name"), str):
                calls = []
                break
            calls.append(ToolCall(call.get("id") or new_id("call_"), function["name"], json.dumps(arguments), arguments))
        if calls:
            text = content or ""
    if calls:
        finish = "tool_calls"
    elif finish_reason == "length":
        finish = "length"
    else:
        finish = "stop_sequence" if stop is not None or (isinstance(stop_reason, str) and stop_reason in prompt.stop) \
            else "stop"
        stop = stop if stop is not None else (stop_reason if finish == "stop_sequence" else None)
    return Turn(text, calls, finish, prompt_tokens, completion_tokens, stop if finish == "stop_sequence" else None)


def hold_point(text: str, markers: tuple[str, ...] | list[str]) -> int:
    """How much of `text` is safe to send: up to the first marker in it, or up to a tail that may still become
    one (a prefix of a marker)."""
    cut = len(text)
    for m in markers:
        i = text.find(m)
        if i >= 0:
            cut = min(cut, i)
            continue
        for k in range(min(len(m) - 1, len(text)), 0, -1):
            if text.endswith(m[:k]):
                cut = min(cut, len(text) - k)
                break
    return cut


class TextDeltas:
    """The engine's ids as they come → the text to send now. The rule: text is sent as soon as it decodes
    (no half character); with tools, from where a tool-call opener (or a stop sequence) may start, text is
    held back, and at the end the tool calls come as whole blocks after the remaining text. Each run of ids is
    decoded with a few ids before it as context (as vLLM's own detokenizer does), not the whole answer again."""

    CONTEXT = 6  # ids decoded before the new ones: a word's leading space, a character's first bytes

    def __init__(self, decode: Callable[[list[int]], str], markers: list[str]) -> None:
        self.decode, self.markers = decode, tuple(m for m in markers if m)
        self.ids: list[int] = []
        self.text = ""  # the decoded text so far
        self.start = self.done = 0  # ids[start:done]: the context of the next decode; ids[:done] are in `text`
        self.sent = ""
        self.held = False  # a marker was seen: nothing more before the end

    def feed(self, ids: list[int]) -> str:
        self.ids += ids
        if self.held or not ids:
            return ""
        before = self.decode(self.ids[self.start:self.done]) if self.done > self.start else ""
        after = self.decode(self.ids[self.start:])
        if after.endswith("\ufffd") or not after.startswith(before):
            return ""  # a character still incomplete: wait for its next bytes
        self.text += after[len(before):]
        self.done = len(self.ids)
        self.start = max(0, self.done - self.CONTEXT)
        safe = hold_point(self.text, self.markers) if self.markers else len(self.text)
        if any(m in self.text for m in self.markers):
            self.held = True
        delta = self.text[len(self.sent):safe] if safe > len(self.sent) else ""
        self.sent += delta
        return delta

    def rest(self, turn: Turn) -> str:
        """What is left of the final text once everything fed has been sent."""
        for sent in (self.sent, self.sent.lstrip()):
            if turn.text.startswith(sent):
                return turn.text[len(sent):]
        return ""


def sse(event: str | None, data: dict) -> bytes:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data)}\n\n".encode()


def string_list(value: Any, name: str, limit: int = 16) -> list[str]:
    """A stop field: absent, one string, or a list of at most `limit` strings."""
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value) or len(value) > limit:
        raise Invalid(f"{name}: a string or a list of at most {limit} non-empty strings")
    return list(value)


def flag(value: Any, name: str) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        raise Invalid(f"{name}: true or false, not {value!r}")
    return value


__all__ = ["Invalid", "Prompt", "TextDeltas", "ToolCall", "ToolParser", "Turn", "flag", "hold_point", "make_turn",
           "new_id", "sse", "string_list", "tool_call_parser"]
