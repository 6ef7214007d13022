"""The per-rollout OpenAI-compatible gateway for black-box harnesses: text in, token ids recorded.

Where it sits: a handler's RUN for `agent.kind: harness` (agents/tasks/harbor.py) starts one
`Gateway` per rollout on a Unix socket in the sandbox's control directory (`/.rolloutd` inside), a
relay inside the sandbox (`RELAY`) serves it on the sandbox's own loopback, and the harness gets
`OPENAI_BASE_URL`. Every call is rendered with the model's chat template (agents/tokenizer.py), sent
token-in/token-out to the rollout's pinned backend (agents/llm.py) and recorded; `stitch` turns the
calls into the trajectory's token sequence. Next step: the trajectory goes to EVAL like any other.

Endpoints: `GET /v1/models`, `POST /v1/chat/completions` (tools: the model family's calls in its
text, agents/toolcall_formats.py chosen from the chat template, become `tool_calls`; `stream: true` answers in server-sent
events, the whole completion in one chunk), `POST /v1/completions` (a text or token-id prompt).
Sampling is the job's (`agent.sampling`), not the harness's: the policy's distribution is the
trainer's to choose; the harness's `max_tokens` only lowers the job's limit.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shlex
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rolloutd.sandbox.relay import RELAY

from .toolcall_formats import format_for
from .llm import BackendError, RequestRejected, SamplingParams, derive_seed
from .openai_wire import (Invalid, chat_messages, chat_tools, completion_prompt, max_tokens, parse_tool_calls,
                          read_body, respond)

INLINE_CHARS = 1 << 16  # a longer text is tokenized in a worker thread, the event loop free meanwhile



async def start_relay(sandbox: Any, socket: str, port: int, log: str, session: dict) -> None:
    """Start `RELAY` in the sandbox (its python: the host's, bound in) from 127.0.0.1:`port` to `socket` (a path
    inside); returns once it listens. RuntimeError when it does not start."""
    script = (f"nohup {shlex.quote(sys.executable)} -I -c {shlex.quote(RELAY)} {shlex.quote(socket)} {port} "
              f"> {log} 2>&1 &\nfor i in $(seq 200); do grep -q ready {log} && exit 0; sleep 0.02; done; cat {log}; exit 1")
    started = await sandbox.bash(f"bash -c {shlex.quote(script)}", timeout=30, **session)
    if started.exit_code != 0:
        raise RuntimeError(f"the relay to {socket} did not start in the sandbox: {started.output[-500:]}")


@dataclass
class Call:
    """One LLM call the harness made, exactly as the engine saw and produced it."""

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str


@dataclass
class Segment:
    """A run of calls each extending the sequence's tokens: one token sequence with its loss mask."""

    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    prompt_length: int = 0
    calls: int = 0
    drift: bool = False  # started because a re-tokenized history no longer matched the recorded ids
    turns: list[tuple[int, int, str]] = field(default_factory=list)  # each call's generated [start, end), finish
    retokenized: int = 0  # prompt ids past the longest prefix shared with an earlier sequence (sent again as text)


def _shared(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def stitch(calls: list[Call], decode=None) -> list[Segment]:
    """Calls → as few sequences as the ids allow. PREFIX MERGE: a call whose prompt starts with the tokens
    of any sequence so far (the longest such) continues it, new prompt tokens with mask 0 and the generated
    ones with mask 1; a harness that made a side call (a title, a summary) and went back to its history
    lands in its old sequence. Any other call starts a new sequence, whose prompt ids past the longest prefix
    shared with an earlier sequence count as `retokenized` (the harness sent that history again as text, or
    rewrote it). With `decode`, a new sequence whose text still starts with the closest one's is marked
    `drift` (the harness kept the history, the tokens changed) rather than a rewrite (compacted, truncated)."""
    segments: list[Segment] = []
    for call in calls:
        prompt = call.prompt_ids
        fits = [s for s in segments if prompt[: len(s.token_ids)] == s.token_ids]
        cur = max(fits, key=lambda s: len(s.token_ids), default=None)
        if cur is not None:
            extra = prompt[len(cur.token_ids):]
        else:
            shared, near = max(((_shared(prompt, s.token_ids), s) for s in segments),
                               key=lambda x: x[0], default=(0, None))
            drift = bool(near is not None and decode is not None and decode(prompt).startswith(decode(near.token_ids)))
            cur = Segment(prompt_length=len(prompt), drift=drift, retokenized=len(prompt) - shared if near else 0)
            segments.append(cur)
            extra = prompt
        cur.token_ids += extra
        cur.loss_mask += [0] * len(extra)
        cur.logprobs += [None] * len(extra)
        if call.token_ids:
            cur.turns.append((len(cur.token_ids), len(cur.token_ids) + len(call.token_ids), call.finish_reason))
        cur.token_ids += call.token_ids
        cur.loss_mask += [1] * len(call.token_ids)
        cur.logprobs += list(call.logprobs)
        cur.calls += 1
    return segments


class PieceEncoder:
    """Ids of rendered chat text, each stretch between the tokenizer's added tokens (`<|im_end|>`...) encoded
    once per rollout: a harness re-sends its whole history every call, and the tokenizer splits on added
    tokens before anything else, so the stretches are independent and the ids those of one `encode_text`.
    Used only where that holds (no strip/normalized added tokens, checked on a probe); else `encode_text`."""

    LIMIT = 4096  # stretches kept per rollout

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[str, list[int]] = {}
        self._split: re.Pattern | None = None
        backend = getattr(getattr(tokenizer, "hf", None), "_tokenizer", None)
        try:
            added = backend.get_added_tokens_decoder()
        except AttributeError:
            return
        if not added or any(t.lstrip or t.rstrip or t.single_word or t.normalized for t in added.values()):
            return
        self._backend, self._ids = backend, {t.content: i for i, t in added.items()}
        self._split = re.compile("(" + "|".join(map(re.escape, sorted(self._ids, key=len, reverse=True))) + ")")
        special = sorted(self._ids)
        probe = f"{special[0]} Hé llo\n  {special[-1]}\n\tx{special[0]}{special[-1]}y  "
        if self.encode(probe) != tokenizer.encode_text(probe):  # e.g. a prefix space only at the text's start
            self._split = None
        self._cache.clear()

    def encode(self, text: str) -> list[int]:
        if self._split is None:
            return self.tokenizer.encode_text(text)
        out: list[int] = []
        for i, piece in enumerate(self._split.split(text)):
            if i % 2:
                out.append(self._ids[piece])
            elif piece:
                ids = self._cache.get(piece)
                if ids is None:
                    ids = self.tokenizer.encode_text(piece)
                    if len(self._cache) < self.LIMIT:
                        self._cache[piece] = ids
                out += ids
        return out


class Gateway:
    """An OpenAI-compatible server over a Unix socket, for one rollout. `calls` records every call."""

    def __init__(self, llm: Any, tokenizer: Any, sampling: SamplingParams, *, model: str = "policy",
                 seed_parts: tuple = (), request_prefix: str = "gw") -> None:
        self.llm, self.tokenizer, self.sampling, self.model = llm, tokenizer, sampling, model
        self.seed_parts, self.request_prefix = seed_parts, request_prefix
        self.calls: list[Call] = []
        self._pieces = PieceEncoder(tokenizer) if tokenizer is not None else None
        self.tool_format = format_for(tokenizer) if tokenizer is not None else None  # the model family's
        self.backend_error: str | None = None  # the last call the backend failed (the rollout is infra)
        self.rejected: str | None = None  # the last call the backend refused as invalid (the job's configuration)
        self._long_texts = asyncio.Semaphore(1)
        self._server: Any = None
        self._task: asyncio.Task | None = None
        self._inflight: set[asyncio.Task] = set()  # backend calls, cancelled by stop (VLLMBackend aborts them)

    # ------------------------------------------------------------------ lifecycle
    async def start(self, socket_path: str | Path) -> None:
        import uvicorn

        config = uvicorn.Config(self, uds=str(socket_path), log_level="warning", lifespan="off",
                                access_log=False)
        self._server = uvicorn.Server(config)
        self._server.install_signal_handlers = lambda: None  # the node daemon owns the signals
        self._task = asyncio.create_task(self._server.serve(), name="gateway")
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
            await asyncio.sleep(0.005)

    async def stop(self) -> None:
        for task in list(self._inflight):  # the rollout ended or was cancelled: its calls end too
            task.cancel()
        if self._server is not None:
            self._server.should_exit = True
            self._server.force_exit = True  # in-flight calls end with the harness (cancelled, aborted)
        if self._task is not None:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(self._task, 5)

    # ------------------------------------------------------------------ the calls
    async def generate(self, prompt_ids: list[int], max_tokens: int | None) -> Call:
        index = len(self.calls)
        limit = self.sampling.max_tokens
        if max_tokens is not None:
            limit = min(limit, max_tokens)
        sampling = self.sampling.model_copy(update={
            "max_tokens": limit, "seed": derive_seed(self.sampling.seed, *self.seed_parts, index)})
        request_id = f"{self.request_prefix}-{index}-{uuid.uuid4().hex[:8]}"
        task = asyncio.ensure_future(self.llm.generate(list(prompt_ids), sampling, request_id))
        self._inflight.add(task)
        try:
            gen = await task
        finally:
            self._inflight.discard(task)
        call = Call(list(prompt_ids), list(gen.token_ids), list(gen.logprobs), gen.finish_reason)
        self.calls.append(call)
        return call

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        """The ASGI app: a plain path dispatch (a framework's middleware and routing cost more per call
        than the whole goal; FACTS and bench/RESULTS-gateway.md). A malformed request is a 4xx
        (`openai_wire`), never a 500."""
        if scope["type"] != "http":
            return
        route = _ROUTES.get(scope["path"].rstrip("/"))
        if route is None:
            return await respond(send, 404, {"error": {"message": f"no route {scope['path']}", "type": "not_found"}})
        method, handler = route
        if scope["method"] != method:
            return await respond(send, 405, {"error": {"message": f"use {method}", "type": "invalid_request_error"}})
        try:
            request = await read_body(scope, receive)
            if request is None:
                return
            await handler(self, request, send)
        except Invalid as e:  # raised before anything is sent
            await respond(send, e.status, e.payload())

    async def _encode(self, text: str) -> list[int]:
        if len(text) <= INLINE_CHARS:
            return self._pieces.encode(text)
        async with self._long_texts:  # a rollout's long texts one at a time: a harness cannot take every core
            return await asyncio.to_thread(self.tokenizer.encode_text_in_thread, text)

    async def _models(self, body: dict, send: Any) -> None:
        await respond(send, 200, {"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": "rolloutd"}]})

    async def _chat(self, body: dict, send: Any) -> None:
        messages, tools = chat_messages(body), chat_tools(body)
        limit = max_tokens(body.get("max_completion_tokens") or body.get("max_tokens"))
        try:
            text = self.tokenizer.render(messages, tools=tools, add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 - the template's own checks (roles, tool shapes) on the harness's input
            raise Invalid(f"the model's chat template cannot render these messages: {type(e).__name__}: {e}") from None
        prompt = await self._encode(text)
        call = await self._call(prompt, limit, send)
        if call is None:
            return
        text = self.tokenizer.decode_content(call.token_ids)
        content, tool_calls = parse_tool_calls(text, self.tool_format) if tools else (text, [])
        finish = "tool_calls" if tool_calls else ("length" if call.finish_reason == "length" else "stop")
        message = {"role": "assistant", "content": content, **({"tool_calls": tool_calls} if tool_calls else {})}
        usage = {"prompt_tokens": len(prompt), "completion_tokens": len(call.token_ids),
                 "total_tokens": len(prompt) + len(call.token_ids)}
        head = {"id": f"chatcmpl-{uuid.uuid4().hex[:12]}", "created": int(time.time()), "model": self.model}
        if not body.get("stream"):
            return await respond(send, 200, {**head, "object": "chat.completion", "usage": usage,
                                             "choices": [{"index": 0, "message": message, "finish_reason": finish}]})
        chunks = [{**head, "object": "chat.completion.chunk",
                   "choices": [{"index": 0, "delta": message, "finish_reason": None}]},
                  {**head, "object": "chat.completion.chunk",
                   "choices": [{"index": 0, "delta": {}, "finish_reason": finish}], "usage": usage}]
        events = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]})
        await send({"type": "http.response.body", "body": events.encode()})

    async def _completions(self, body: dict, send: Any) -> None:
        prompt = completion_prompt(body, getattr(self.tokenizer, "vocab_size", None))
        limit = max_tokens(body.get("max_tokens"))
        ids = await self._encode(prompt) if isinstance(prompt, str) else prompt
        call = await self._call(ids, limit, send)
        if call is None:
            return
        await respond(send, 200, {"id": f"cmpl-{uuid.uuid4().hex[:12]}", "object": "text_completion",
                                  "created": int(time.time()), "model": self.model,
                                  "choices": [{"index": 0, "text": self.tokenizer.decode(call.token_ids),
                                               "finish_reason": call.finish_reason}],
                                  "usage": {"prompt_tokens": len(ids), "completion_tokens": len(call.token_ids),
                                            "total_tokens": len(ids) + len(call.token_ids)}})

    async def _call(self, prompt: list[int], limit: int | None, send: Any) -> Call | None:
        try:
            return await self.generate(prompt, limit)
        except BackendError as e:  # the harness sees a 502; the rollout's RUN reports it as infra
            self.backend_error = str(e)
            await respond(send, 502, {"error": {"message": f"backend: {e}", "type": "backend_error"}})
        except RequestRejected as e:  # the prompt is checked above: the job's sampling fields; RUN reports config
            self.rejected = str(e)
            await respond(send, 400, {"error": {"message": f"backend refused the request: {e}",
                                                "type": "invalid_request_error"}})
        return None


_ROUTES = {"/v1/models": ("GET", Gateway._models), "/v1/chat/completions": ("POST", Gateway._chat),
           "/v1/completions": ("POST", Gateway._completions)}


__all__ = ["Call", "Gateway", "PieceEncoder", "RELAY", "Segment", "start_relay", "stitch"]
