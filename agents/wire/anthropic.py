"""Anthropic Messages (`POST /v1/messages`, `/v1/messages/count_tokens`) ↔ the gateway's `Prompt` / `Turn`.

Request: `system` (a string or text blocks), `messages` whose content is a string or blocks (text, tool_use in
assistant turns, tool_result in user turns; thinking blocks dropped), `tools` (`input_schema`; server tools
without one are left out), `tool_choice`, `stop_sequences`, `max_tokens` (required, as the real API). Other
fields (metadata, temperature, thinking, cache_control, ...) are ignored: sampling is the job's. Streaming:
message_start, ping, per block content_block_start / _delta (text_delta, input_json_delta) / _stop,
message_delta (stop_reason, usage), message_stop. Used by agents/gateway/server.py; next step: the template renders.
"""
from __future__ import annotations

import json
from typing import Any

from .openai import function_tool, max_tokens
from . import Invalid, Prompt, Turn, flag, new_id, sse, string_list

STOP = {"stop": "end_turn", "stop_sequence": "stop_sequence", "length": "max_tokens", "tool_calls": "tool_use"}
ERRORS = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
          413: "request_too_large", 502: "api_error"}


def _text(content: Any, where: str) -> str:
    """A string, or text blocks joined (a tool_result's content)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise Invalid(f"{where}: a string or a list of text blocks")
    texts = []
    for j, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise Invalid(f"{where}[{j}]: only text blocks ({{\"type\": \"text\", \"text\": ...}})")
        texts.append(block["text"])
    return "".join(texts)


def _message(i: int, message: Any) -> list[dict]:
    """One Anthropic message → chat-template messages (tool results become `tool` messages first)."""
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise Invalid(f"{where}: must be an object")
    role = message.get("role")
    if role not in ("user", "assistant"):
        raise Invalid(f"{where}.role: \"user\" or \"assistant\", not {role!r}")
    content = message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise Invalid(f"{where}.content: a string or a list of content blocks")
    texts, calls, results = [], [], []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("name"), str) or not isinstance(block.get("input", {}), dict):
                raise Invalid(f"{at}: a tool_use block needs a string name and an object input")
            calls.append({"id": str(block.get("id") or new_id("toolu_")), "type": "function",
                          "function": {"name": block["name"], "arguments": block.get("input", {})}})
        elif kind == "tool_result" and role == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise Invalid(f"{at}.tool_use_id: a string is required")
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                            "content": _text(block.get("content", ""), f"{at}.content")})
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue
        else:
            raise Invalid(f"{at}: a {kind!r} block is not supported in a {role} message "
                          "(text, tool_use in assistant turns, tool_result in user turns)")
    out = list(results)
    if texts or calls or not results:
        out.append({"role": role, "content": "".join(texts), **({"tool_calls": calls} if calls else {})})
    return out


def _tools(body: dict) -> list[dict] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise Invalid("tools: a list of tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise Invalid(f"tools[{i}]: an object with a string name")
        if "input_schema" not in tool:  # a server tool (web search, ...): not the model's to call here
            continue
        if not isinstance(tool["input_schema"], dict):
            raise Invalid(f"tools[{i}].input_schema: a JSON schema object")
        out.append(function_tool(tool["name"], tool["input_schema"], tool.get("description")))
    return out or None


def parse(body: dict, *, counting: bool = False) -> Prompt:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise Invalid("messages: a non-empty list of messages is required")
    system = body.get("system")
    chat = [{"role": "system", "content": _text(system, "system")}] if system not in (None, "", []) else []
    for i, message in enumerate(messages):
        chat += _message(i, message)
    choice = body.get("tool_choice")
    if choice is not None and not (isinstance(choice, dict) and isinstance(choice.get("type"), str)):
        raise Invalid("tool_choice: an object with a type (auto, any, tool, none)")
    limit = None
    if not counting:
        if "max_tokens" not in body:
            raise Invalid("max_tokens: a positive integer is required")
        limit = max_tokens(body["max_tokens"])
    return Prompt(chat, _tools(body), limit, string_list(body.get("stop_sequences"), "stop_sequences"),
                  flag(body.get("stream"), "stream"), (choice or {}).get("type") != "none")


def error(status: int, message: str, kind: str) -> dict:
    return {"type": "error", "error": {"type": ERRORS.get(status, "invalid_request_error"), "message": message}}


def _blocks(turn: Turn) -> list[dict]:
    blocks = [{"type": "text", "text": turn.text}] if turn.text else []
    return blocks + [{"type": "tool_use", "id": "toolu_" + c.id.removeprefix("call_"), "name": c.name,
                      "input": c.input} for c in turn.tool_calls]


def reply(turn: Turn, model: str, body: dict | None = None) -> dict:
    return {"id": new_id("msg_"), "type": "message", "role": "assistant", "model": model, "content": _blocks(turn),
            "stop_reason": STOP[turn.finish], "stop_sequence": turn.stop_sequence,
            "usage": {"input_tokens": turn.prompt_tokens, "output_tokens": turn.completion_tokens}}


class Events:
    """The server-sent events of one streamed message, as bytes. A text block opens at the first text."""

    def __init__(self, model: str, prompt_tokens: int, body: dict | None = None) -> None:
        self.model, self.prompt_tokens = model, prompt_tokens
        self.index = -1  # the open block; -1: none yet
        self.texting = False

    def start(self) -> bytes:
        message = {"id": new_id("msg_"), "type": "message", "role": "assistant", "model": self.model, "content": [],
                   "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0}}
        return sse("message_start", {"type": "message_start", "message": message}) + sse("ping", {"type": "ping"})

    def _open(self, block: dict) -> bytes:
        self.index += 1
        return sse("content_block_start", {"type": "content_block_start", "index": self.index, "content_block": block})

    def _close(self) -> bytes:
        return sse("content_block_stop", {"type": "content_block_stop", "index": self.index})

    def text(self, delta: str) -> bytes:
        if not delta:
            return b""
        out = b""
        if not self.texting:
            self.texting = True
            out = self._open({"type": "text", "text": ""})
        return out + sse("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                 "delta": {"type": "text_delta", "text": delta}})

    def end(self, turn: Turn, rest: str) -> bytes:
        out = self.text(rest)
        if self.texting:
            out += self._close()
        for block in _blocks(turn)[1 if turn.text else 0:]:
            out += self._open({**block, "input": {}})
            out += sse("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                               "delta": {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}})
            out += self._close()
        out += sse("message_delta", {"type": "message_delta",
                                     "delta": {"stop_reason": STOP[turn.finish], "stop_sequence": turn.stop_sequence},
                                     "usage": {"output_tokens": turn.completion_tokens}})
        return out + sse("message_stop", {"type": "message_stop"})

    def failed(self, message: str) -> bytes:
        return sse("error", error(502, f"backend: {message}", "backend_error"))
