"""OpenAI Responses (`POST /v1/responses`) ↔ the gateway's `Prompt` / `Turn` / text deltas.

Request: `input` (a string, or items: messages with string or text-part content, `function_call`,
`function_call_output`; `reasoning` items dropped), `instructions`, `tools` of type function (other tool
types are left out), `tool_choice`, `max_output_tokens`. Nothing is stored: `previous_response_id` is refused.
Streaming: response.created, response.in_progress, per output item output_item.added, (a message)
content_part.added, output_text.delta..., output_text.done, content_part.done, (a call)
function_call_arguments.delta/done, output_item.done, then response.completed (or .incomplete), each event
with its `sequence_number`. Used by agents/gateway/server.py; next step: the template renders the messages.
"""
from __future__ import annotations

import json
import time
from typing import Any

from .openai import function_tool, max_tokens
from . import Invalid, Prompt, Turn, flag, new_id, sse

ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise Invalid(f"{where}: a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        if (not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text")
                or not isinstance(part.get("text"), str)):
            raise Invalid(f"{where}[{j}]: only text parts (input_text, output_text)")
        texts.append(part["text"])
    return "".join(texts)


def _items(items: list) -> list[dict]:
    chat: list[dict] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise Invalid(f"{where}: must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = ROLES.get(item.get("role"))
            if role is None:
                raise Invalid(f"{where}.role: user, assistant, system or developer, not {item.get('role')!r}")
            chat.append({"role": role, "content": _content(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            if not isinstance(item.get("name"), str) or not isinstance(item.get("call_id"), str) \
                    or not isinstance(item.get("arguments"), str):
                raise Invalid(f"{where}: a function_call needs string name, call_id and arguments")
            try:
                arguments = json.loads(item["arguments"] or "{}")
            except (ValueError, RecursionError):
                arguments = item["arguments"]
            call = {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": arguments}}
            if chat and chat[-1]["role"] == "assistant":  # the same turn's text or calls
                chat[-1].setdefault("tool_calls", []).append(call)
            else:
                chat.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str):
                raise Invalid(f"{where}.call_id: a string is required")
            chat.append({"role": "tool", "tool_call_id": item["call_id"],
                         "content": _content(output, f"{where}.output")})
        elif kind == "reasoning":
            continue
        else:
            raise Invalid(f"{where}.type: {kind!r} is not supported (message, function_call, function_call_output)")
    return chat


def _tools(body: dict) -> list[dict] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise Invalid("tools: a list of tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise Invalid(f"tools[{i}]: must be an object")
        if tool.get("type") != "function":  # built-in tools (web_search, local_shell, custom): not served here
            continue
        if not isinstance(tool.get("name"), str) or not isinstance(tool.get("parameters", {}), (dict, type(None))):
            raise Invalid(f"tools[{i}]: a function tool needs a string name and an object parameters")
        out.append(function_tool(tool["name"], tool.get("parameters") or {}, tool.get("description")))
    return out or None


def parse(body: dict) -> Prompt:
    if body.get("previous_response_id") is not None:
        raise Invalid("previous_response_id: the gateway stores no responses; send the whole input")
    given = body.get("input")
    if isinstance(given, str):
        chat = [{"role": "user", "content": given}]
    elif isinstance(given, list) and given:
        chat = _items(given)
    else:
        raise Invalid("input: a string or a non-empty list of input items is required")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise Invalid("instructions: a string")
    system = [instructions] if instructions else []
    while chat and chat[0]["role"] == "system":  # the templates take one system message, first
        system.append(chat.pop(0)["content"])
    if system:
        chat.insert(0, {"role": "system", "content": "\n\n".join(system)})
    if not any(m["role"] != "system" for m in chat):
        raise Invalid("input: at least one item besides instructions is required")
    choice = body.get("tool_choice")
    if choice is not None and not isinstance(choice, (str, dict)):
        raise Invalid("tool_choice: a string or an object")
    return Prompt(chat, _tools(body), max_tokens(body.get("max_output_tokens")), [], flag(body.get("stream"), "stream"),
                  choice != "none")


def error(status: int, message: str, kind: str) -> dict:
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


def _message(item_id: str, text: str, status: str) -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []}


def _call(call: Any, status: str) -> dict:
    return {"type": "function_call", "id": "fc_" + call.id.removeprefix("call_"), "call_id": call.id,
            "name": call.name, "arguments": call.arguments if status == "completed" else "", "status": status}


class Events:
    """The events of one response (also builds the non-streamed response: `response`)."""

    def __init__(self, model: str, prompt_tokens: int, body: dict | None = None) -> None:
        self.model, self.body, self.seq = model, body or {}, 0
        self.id, self.message_id, self.created = new_id("resp_"), new_id("msg_"), int(time.time())
        self.texting = False

    def response(self, status: str, output: list, turn: Turn | None = None) -> dict:
        usage = None if turn is None else {
            "input_tokens": turn.prompt_tokens, "output_tokens": turn.completion_tokens,
            "total_tokens": turn.prompt_tokens + turn.completion_tokens,
            "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}}
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status, "model": self.model,
                "output": output, "error": None, "usage": usage, "parallel_tool_calls": True,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": self.body.get("instructions"), "tools": self.body.get("tools") or [],
                "tool_choice": self.body.get("tool_choice") or "auto", "metadata": {}, "temperature": None,
                "top_p": None, "text": {"format": {"type": "text"}}}

    def _e(self, kind: str, **data: Any) -> bytes:
        out = sse(kind, {"type": kind, "sequence_number": self.seq, **data})
        self.seq += 1
        return out

    def start(self) -> bytes:
        return (self._e("response.created", response=self.response("in_progress", []))
                + self._e("response.in_progress", response=self.response("in_progress", [])))

    def text(self, delta: str) -> bytes:
        if not delta:
            return b""
        out = b""
        if not self.texting:
            self.texting = True
            out = (self._e("response.output_item.added", output_index=0,
                           item=_message(self.message_id, "", "in_progress"))
                   + self._e("response.content_part.added", item_id=self.message_id, output_index=0, content_index=0,
                             part={"type": "output_text", "text": "", "annotations": []}))
        return out + self._e("response.output_text.delta", item_id=self.message_id, output_index=0, content_index=0,
                             delta=delta, logprobs=[])

    def output(self, turn: Turn) -> list[dict]:
        message = [_message(self.message_id, turn.text, "completed")] if turn.text else []
        return message + [_call(c, "completed") for c in turn.tool_calls]

    def end(self, turn: Turn, rest: str) -> bytes:
        out = self.text(rest)
        output = self.output(turn)
        if self.texting:
            text = output[0]["content"][0]["text"] if turn.text else ""
            part = {"type": "output_text", "text": text, "annotations": []}
            out += (self._e("response.output_text.done", item_id=self.message_id, output_index=0, content_index=0,
                            text=text, logprobs=[])
                    + self._e("response.content_part.done", item_id=self.message_id, output_index=0, content_index=0,
                              part=part)
                    + self._e("response.output_item.done", output_index=0, item=_message(self.message_id, text, "completed")))
        first = 1 if self.texting else 0
        for index, call in enumerate(turn.tool_calls, start=first):
            item = _call(call, "completed")
            out += (self._e("response.output_item.added", output_index=index, item=_call(call, "in_progress"))
                    + self._e("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                              delta=call.arguments)
                    + self._e("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                              name=call.name, arguments=call.arguments)
                    + self._e("response.output_item.done", output_index=index, item=item))
        status = "incomplete" if turn.finish == "length" else "completed"
        return out + self._e(f"response.{status}", response=self.response(status, output, turn))

    def failed(self, message: str) -> bytes:
        failed = {**self.response("failed", []), "error": {"code": "server_error", "message": f"backend: {message}"}}
        return self._e("response.failed", response=failed)


def reply(turn: Turn, model: str, body: dict | None = None) -> dict:
    events = Events(model, turn.prompt_tokens, body)
    return events.response("incomplete" if turn.finish == "length" else "completed", events.output(turn), turn)
