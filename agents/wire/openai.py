"""The OpenAI-compatible wire of the harness gateway: a request is checked before it reaches the chat template,
the tokenizer or the engine (a malformed one is a 400 naming the field, never a 500), bodies are bounded, tool
calls are parsed out of the model's text, and answers are written as JSON.

Used by agents/gateway/server.py and the dialects beside it (agents/wire/), whose callers are black-box harnesses:
model-driven code in a sandbox, so every request may be hostile. Next step: the gateway renders the checked messages, tokenizes and calls the engine.
"""
from __future__ import annotations

import json
import uuid
from typing import Any
from rolloutd.crds.errors import AgentError
from rolloutd.crds.kit.documents import unreadable

from ..toolcall_formats import FORMATS, Format

# One request's body: ~8x the JSON of a whole 128k-token history. A larger one is refused (413) before it is
# read in whole, so a harness cannot grow the node daemon's memory or keep its tokenizer busy for minutes.
MAX_BODY = 4 << 20


class Invalid(AgentError):
    """A request the gateway refuses: `status` and an OpenAI-style error body."""

    def __init__(self, message: str, status: int = 400, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.error_type = status, kind  # `kind` is the taxonomy's (rolloutd.crds.errors)

    def payload(self) -> dict:
        return {"error": {"message": str(self), "type": self.error_type}}


async def read_body(scope: dict, receive: Any) -> dict | None:
    """The request's JSON object (an empty body: {}); None when the client went away. Invalid: too large,
    not JSON, or not an object."""
    declared = dict(scope.get("headers") or []).get(b"content-length", b"")
    if declared.isdigit() and int(declared) > MAX_BODY:
        raise Invalid(f"request body of {int(declared)} bytes: the gateway takes at most {MAX_BODY}", 413)
    chunks, size, more = [], 0, True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY:
            raise Invalid(f"request body over {MAX_BODY} bytes: the gateway takes at most {MAX_BODY}", 413)
        chunks.append(chunk)
        more = message.get("more_body", False)
    if not size:
        return {}
    try:
        request = json.loads(b"".join(chunks))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise Invalid(f"the body is not JSON: {e}") from None
    except (ValueError, RecursionError) as e:  # an integer of more digits than Python converts (4300), deep nesting
        raise Invalid(f"the body: {unreadable(e)}") from None
    if not isinstance(request, dict):
        raise Invalid("the body must be a JSON object")
    return request


def chat_messages(body: dict) -> list[dict]:
    """`messages`, checked, with content parts (`[{"type": "text", "text": ...}]`) joined into one string and
    a null content (an assistant turn of tool calls) made empty, as the templates expect."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise Invalid("messages: a non-empty list of messages is required")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise Invalid(f"messages[{i}]: must be an object")
        if not isinstance(message.get("role"), str):
            raise Invalid(f"messages[{i}].role: a string is required")
        content = message.get("content")
        if isinstance(content, list):
            texts = [part.get("text") if isinstance(part, dict) else None for part in content]
            bad = next((j for j, t in enumerate(texts) if not isinstance(t, str)), None)
            if bad is not None:
                raise Invalid(f"messages[{i}].content[{bad}]: only text parts ({{\"type\": \"text\", \"text\": ...}})")
            content = "".join(texts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise Invalid(f"messages[{i}].content: a string, a list of text parts or null")
        checked.append({**message, "content": content})
    return checked


def chat_tools(body: dict) -> list[dict] | None:
    tools = body.get("tools")
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise Invalid("tools: a list of tool objects")
    return tools


def function_tool(name: str, parameters: dict, description: Any = None) -> dict:
    """One tool in OpenAI chat's function shape (what the chat template renders), from another dialect's tool."""
    return {"type": "function", "function": {"name": name, "parameters": parameters,
                                             **({"description": description} if isinstance(description, str) else {})}}


def max_tokens(value: Any) -> int | None:
    """The harness's `max_tokens` (or `max_completion_tokens`): a positive integer, or none given."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise Invalid(f"max_tokens: a positive integer, not {value!r}")
    return value


def completion_prompt(body: dict, vocab_size: int | None) -> str | list[int]:
    """`prompt` of /v1/completions: a text, or token ids of the tokenizer (one of each in a list of one)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
        bad = next((i for i in prompt if i < 0 or (vocab_size is not None and i >= vocab_size)), None)
        if bad is not None:
            raise Invalid(f"prompt: token id {bad} is not one of the tokenizer's (0 to {vocab_size - 1})"
                          if vocab_size is not None else f"prompt: token id {bad} is negative")
        return prompt
    raise Invalid("prompt must be a string or a list of token ids")


def parse_tool_calls(text: str, fmt: Format | None = None) -> tuple[str | None, list[dict]]:
    """The model's tool calls in its family's format `fmt` (agents/toolcall_formats.py; Hermes when not
    given) → (the text left, or None; OpenAI `tool_calls`). A malformed call stays in the text, as the real
    APIs answer it."""
    content, calls = (fmt or FORMATS["hermes"]).split(text)
    return content, [{"id": f"call_{uuid.uuid4().hex[:12]}", "type": "function",
                      "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for c in calls]


async def respond(send: Any, status: int, payload: dict) -> None:
    data = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})


__all__ = ["Invalid", "MAX_BODY", "chat_messages", "chat_tools", "completion_prompt", "function_tool", "max_tokens",
           "parse_tool_calls", "read_body", "respond"]
