"""Tool-call formats per model family: which one a model speaks, read from its chat template, and a parser
for each that turns the model's decoded text into calls.

Where it sits: the built-in agent loop (agents/loop/tools.py `parse_tool_calls`) and the harness gateway
(agents/wire/openai.py `parse_tool_calls`, its one call site) both call `format_for(tokenizer)` once and
`fmt.parse(text)` on every assistant turn. Next step: tools.py validates and executes the calls; the gateway
answers them as OpenAI `tool_calls` (and the other dialects as theirs).

Formats:
- `hermes` (Qwen, Hermes, the tiny test model): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  several per turn; an unclosed last one is read to the end of the text.
- `llama3` (Llama 3.1/3.2/3.3): the whole answer is `{"name": ..., "parameters": {...}}` (several joined
  by `;`), optionally after `<|python_tag|>`.
- `mistral`: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]` (v3 tokenizers), or
  `[TOOL_CALLS]name[ARGS]{...}` (v11+).
The markers `<|python_tag|>` and `[TOOL_CALLS]` are special tokens that a content decode drops; each parser
also accepts its structure without them. A call that does not parse is a `RawCall` with `error` set and
stays in the text: the caller shows it as text (the gateway) or reports the error (the agent loop).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from rolloutd.crds.kit.documents import unreadable

_DECODER = json.JSONDecoder()


@dataclass
class RawCall:
    """One call as the model wrote it: `arguments` a dict, or `error` saying why it is not a call."""

    name: str
    arguments: dict[str, Any]
    error: str | None
    span: tuple[int, int]  # where in the text it was written


# what a model's JSON may raise besides a syntax error: an integer of more digits than Python converts (ValueError),
# nesting past the recursion limit; the call is then text, as a malformed one is
UNREADABLE = (ValueError, RecursionError)


def _call(obj: Any, span: tuple[int, int], args_keys: tuple[str, ...]) -> RawCall:
    if not isinstance(obj, dict):
        return RawCall("", {}, "the tool call must be a JSON object", span)
    name = obj.get("name")
    args: Any = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except UNREADABLE:
            pass
    if not isinstance(name, str) or not name:
        return RawCall("", {}, 'the call has no "name"', span)
    if not isinstance(args, dict):
        return RawCall(name, {}, f'"arguments" of {name} must be a JSON object', span)
    return RawCall(name, args, None, span)


def _bad_json(e: Exception, span: tuple[int, int]) -> RawCall:
    why = f"{e.msg} at char {e.pos}" if isinstance(e, json.JSONDecodeError) else unreadable(e)
    return RawCall("", {}, f"the tool call is not valid JSON ({why})", span)


class Format:
    name = "base"
    marker = ""
    openers: tuple[str, ...] = ()  # texts a call may start with: a stream holds its text back from there

    def parse(self, text: str) -> list[RawCall]:
        raise NotImplementedError

    def split(self, text: str) -> tuple[str | None, list[RawCall]]:
        """(the text left once the well-formed calls are cut out, or None when nothing is left; the
        well-formed calls). A malformed call stays in the text."""
        calls = [c for c in self.parse(text) if c.error is None]
        if not calls:
            return text, []
        kept, at = [], 0
        for c in calls:
            kept.append(text[at:c.span[0]])
            at = c.span[1]
        kept.append(text[at:])
        rest = "".join(kept).strip()
        return rest or None, calls


class Hermes(Format):
    name, marker = "hermes", "<tool_call>"
    openers = ("<tool_call>",)
    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)

    def parse(self, text: str) -> list[RawCall]:
        calls = []
        for m in self._BLOCK.finditer(text):
            span = (m.start(), m.end())
            try:
                obj = json.loads(m.group(1).strip())
            except UNREADABLE as e:
                calls.append(_bad_json(e, span))
                continue
            calls.append(_call(obj, span, ("arguments", "parameters")))
        return calls


class Llama3(Format):
    name, marker = "llama3", "<|python_tag|>"
    openers = ("<|python_tag|>", "{")  # the marker is dropped by a content decode: a call is a JSON answer

    def parse(self, text: str) -> list[RawCall]:
        body = text.strip()
        if body.startswith(self.marker):
            body = body[len(self.marker):].lstrip()
        if not body.startswith("{"):
            return []  # plain text: a final answer
        whole, calls, at = (0, len(text)), [], 0
        while True:
            try:
                obj, end = _DECODER.raw_decode(body, at)
            except UNREADABLE as e:
                return [_bad_json(e, whole)]
            calls.append(_call(obj, whole if not calls else (len(text), len(text)), ("parameters", "arguments")))
            rest = body[end:].lstrip()
            if not rest:
                return calls
            if not rest.startswith(";"):  # JSON then prose: not a call (as vLLM's Llama parser reads it)
                return [RawCall("", {}, "text after the tool call's JSON", whole)]
            at = len(body) - len(rest[1:].lstrip())


class Mistral(Format):
    name, marker = "mistral", "[TOOL_CALLS]"
    openers = ("[TOOL_CALLS]", "[{")
    _NAMED = re.compile(r"\s*([A-Za-z0-9_.-]+)\[ARGS\]")

    def parse(self, text: str) -> list[RawCall]:
        if self.marker in text:
            starts = [m.end() for m in re.finditer(re.escape(self.marker), text)]
        elif text.lstrip().startswith("[{"):
            starts = [len(text) - len(text.lstrip())]
        else:
            return []
        calls: list[RawCall] = []
        for i, at in enumerate(starts):
            stop = starts[i + 1] - len(self.marker) if i + 1 < len(starts) else len(text)
            calls += self._one(text, at, stop, at - len(self.marker) if self.marker in text else at)
        return calls

    def _one(self, text: str, at: int, stop: int, begin: int) -> list[RawCall]:
        named = self._NAMED.match(text, at)
        try:
            if named:  # [TOOL_CALLS]name[ARGS]{...}
                obj, end = _DECODER.raw_decode(text, named.end())
                return [_call({"name": named.group(1), "arguments": obj}, (begin, end), ("arguments",))]
            at += len(text[at:]) - len(text[at:].lstrip())
            items, end = _DECODER.raw_decode(text, at)
        except UNREADABLE as e:
            return [_bad_json(e, (begin, stop))]
        if not isinstance(items, list):
            items = [items]
        calls = [_call(obj, (begin, end), ("arguments", "parameters")) for obj in items]
        for c in calls[1:]:
            c.span = (end, end)  # one span for the whole list: cut once
        return calls or [RawCall("", {}, "an empty list of tool calls", (begin, end))]


FORMATS = {f.name: f for f in (Hermes(), Llama3(), Mistral())}


def format_for(tokenizer_or_template: Any) -> Format:
    """The format a chat template teaches its model (a ChatTokenizer, a Hugging Face tokenizer or the
    template's text). Hermes when the template names no other (the tiny model, templates without tools)."""
    template = tokenizer_or_template
    if not isinstance(template, str):
        template = getattr(tokenizer_or_template, "template", None) or getattr(
            getattr(tokenizer_or_template, "hf", tokenizer_or_template), "chat_template", None) or ""
    if isinstance(template, dict):
        template = "\n".join(v for v in template.values() if isinstance(v, str))
    if "[TOOL_CALLS]" in template:
        return FORMATS["mistral"]
    if "<tool_call>" in template:
        return FORMATS["hermes"]
    if "<|python_tag|>" in template or ('"parameters": ' in template and "<|start_header_id|>" in template):
        return FORMATS["llama3"]
    return FORMATS["hermes"]


__all__ = ["FORMATS", "Format", "RawCall", "format_for"]
