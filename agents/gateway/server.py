"""The per-rollout gateway for black-box harnesses, in their own dialects: text in, token ids recorded.

Where it sits: a handler's RUN for `agent.kind: harness` (agents/tasks/harbor.py) starts one
`Gateway` per rollout on a Unix socket in the sandbox's control directory (`/.rolloutd` inside), a
relay inside the sandbox (`RELAY`) serves it on the sandbox's own loopback, and the harness gets
`OPENAI_BASE_URL` / `ANTHROPIC_BASE_URL`. Every call is parsed by its dialect (agents/wire/), rendered with
the model's chat template (agents/tokenizer.py), sent token-in/token-out to the rollout's pinned backend
(agents/vllm_backend.py) and recorded (agents/gateway/calls.py); `stitch` turns the calls into the trajectory's token
sequences. Next step: the trajectory goes to EVAL like any other.

Endpoints: `GET /v1/models`, `POST /v1/chat/completions`, `POST /v1/messages` (+ `/count_tokens`), `POST
/v1/responses` (each may stream: the text is sent as the engine produces tokens, held back from where a tool
call may start; the tool calls follow whole), `POST /v1/completions` (a text or token-id prompt). Auth
headers are accepted and not checked: the socket is the boundary. Sampling is the job's (`agent.sampling`),
not the harness's: the harness's `max_tokens` only lowers the job's limit, its stop sequences are added. The
job's token budget (`agent.sampling.maxTotalTokens`, as the agent loop reads it) bounds each call, prompt and
generation together: a rendered prompt that leaves no room for one generated token is answered 400 in the
dialect's error shape, naming the budget and the prompt's length, and never reaches the engine (`over_budget`).
"""
from __future__ import annotations

import asyncio
import contextlib
import shlex
import sys
import time
import uuid
from pathlib import Path
from collections.abc import Awaitable, Callable
from typing import Any

from rolloutd.sandbox.host.unixsock import listening
from rolloutd.sandbox.relay import RELAY

from rolloutd.crds.kit import trace_spans, tracing
from .calls import Call, PieceEncoder, Segment, stitch
from ..llm import BackendError, Generation, RequestRejected, SamplingParams, derive_seed
from ..wire.openai import Invalid, completion_prompt, max_tokens, read_body, respond
from ..wire import Prompt, TextDeltas, Turn, make_turn, tool_call_parser
from ..wire import anthropic, chat
from ..wire.dialect import DIALECTS, Dialect

INLINE_CHARS = 1 << 16  # a longer text is tokenized in a worker thread, the event loop free meanwhile
ENGINE_CALLS = 1  # engine calls of one rollout at once: a harness's parallel calls wait their turn (one episode
# is admitted per backend slot: it may not hold more of the shared engine than that)
REQUESTS_IN_FLIGHT = 4  # calls of one rollout being read, rendered or waiting at once: more are 429 (bodies of
# up to MAX_BODY each, held in the node daemon's memory)
MAX_MESSAGES = 4096  # messages of one call



async def start_relay(sandbox: Any, socket: str, port: int, log: str, session: dict) -> None:
    """Start `RELAY` in the sandbox (its python: the host's, bound in) from 127.0.0.1:`port` to `socket` (a path
    inside); returns once it listens. RuntimeError when it does not start."""
    script = (f"nohup {shlex.quote(sys.executable)} -I -c {shlex.quote(RELAY)} {shlex.quote(socket)} {port} "
              f"> {log} 2>&1 &\nfor i in $(seq 200); do grep -q ready {log} && exit 0; sleep 0.02; done; cat {log}; exit 1")
    started = await sandbox.bash(f"bash -c {shlex.quote(script)}", timeout=30, **session)
    if started.exit_code != 0:
        raise RuntimeError(f"the relay to {socket} did not start in the sandbox: {started.output[-500:]}")


class Gateway:
    """The harness's model server over a Unix socket, for one rollout. `calls` records every call."""

    def __init__(self, llm: Any, tokenizer: Any, sampling: SamplingParams, *, model: str = "policy",
                 seed_parts: tuple = (), request_prefix: str = "gw", max_total_tokens: int | None = None) -> None:
        self.llm, self.tokenizer, self.sampling, self.model = llm, tokenizer, sampling, model
        self.max_total_tokens = max_total_tokens  # the job's budget per call (prompt + generation); None: the engine's
        self.seed_parts, self.request_prefix = seed_parts, request_prefix
        self.calls: list[Call] = []
        self._pieces = PieceEncoder(tokenizer) if tokenizer is not None else None
        self.tools = tool_call_parser(tokenizer)  # the model family's tool-call format
        self.backend_error: str | None = None  # the last call the backend failed (the rollout is infra)
        self.rejected: str | None = None  # the last call the backend refused as invalid (the job's configuration)
        # the first prompt refused for the job's token budget, and whether it came before any call was served (the
        # task's own prompt does not fit: the job's configuration) or after (the conversation grew: the agent's limit)
        self.over_budget: str | None = None
        self.over_budget_first = False
        self._long_texts = asyncio.Semaphore(1)
        self._engine_calls = asyncio.Semaphore(ENGINE_CALLS)
        self._requests = 0
        self._server: Any = None
        self._task: asyncio.Task | None = None
        self._inflight: set[asyncio.Task] = set()  # backend calls, cancelled by stop (VLLMBackend aborts them)
        self._trace = tracing.context()  # the rollout's RUN span: the harness's calls are served in other tasks

    # ------------------------------------------------------------------ lifecycle
    async def start(self, socket_path: str | Path) -> None:
        import uvicorn

        config = uvicorn.Config(self, uds=str(socket_path), log_level="warning", lifespan="off",
                                access_log=False)
        self._server = uvicorn.Server(config)
        self._server.install_signal_handlers = lambda: None  # the node daemon owns the signals
        # bound here (0666, as uvicorn makes a uds; its 0700 directory keeps others out): the sandbox's ctl/ may be
        # deeper than a socket's path can be long
        sock = listening(socket_path, 0o666)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="gateway")
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
    async def generate(self, prompt_ids: list[int], max_tokens: int | None, stop: list[str] | None = None,
                       on_tokens: Any = None) -> Call:
        """One engine call, recorded. With `on_tokens` (an async callable) and a backend that streams, each run
        of ids is handed to it as the engine produces it (an empty one first when the engine has taken the call:
        the response may start), but the last (it comes with the finish: the caller sends it with the answer's
        end, one write); the recorded call holds all of them, exactly."""
        index = len(self.calls)
        limit = self.sampling.max_tokens
        if max_tokens is not None:
            limit = min(limit, max_tokens)
        if self.max_total_tokens is not None:  # the rest of the job's budget (`_call` refused a prompt that fills it)
            limit = max(1, min(limit, self.max_total_tokens - len(prompt_ids)))
        update: dict[str, Any] = {"max_tokens": limit, "seed": derive_seed(self.sampling.seed, *self.seed_parts, index)}
        if stop:
            update["stop"] = [*self.sampling.stop, *(s for s in stop if s not in self.sampling.stop)]
        sampling = self.sampling.model_copy(update=update)
        request_id = f"{self.request_prefix}-{index}-{uuid.uuid4().hex[:8]}"
        async with self._engine_calls:
            task = asyncio.ensure_future(self._produce(list(prompt_ids), sampling, request_id, on_tokens))
            self._inflight.add(task)
            try:
                gen = await task
            finally:
                self._inflight.discard(task)
        call = Call(list(prompt_ids), list(gen.token_ids), list(gen.logprobs), gen.finish_reason, gen.stop_reason,
                    list(getattr(gen, "versions", None) or []))
        self.calls.append(call)
        return call

    async def _produce(self, prompt_ids: list[int], sampling: SamplingParams, request_id: str,
                       on_tokens: Any) -> Generation:
        if on_tokens is not None and getattr(self.llm, "gated", False):  # the node's policy gate: held, tagged
            return await self.llm.generate(prompt_ids, sampling, request_id, on_tokens=on_tokens)
        stream = getattr(self.llm, "stream", None)
        if on_tokens is None or stream is None:
            return await self.llm.generate(prompt_ids, sampling, request_id)
        ids: list[int] = []
        logprobs: list[float] = []
        last: Generation | None = None
        async for piece in stream(prompt_ids, sampling, request_id):
            ids += piece.token_ids
            logprobs += piece.logprobs
            last = piece
            if not piece.finish_reason:
                await on_tokens(piece.token_ids)
        if last is None or not last.finish_reason:
            raise BackendError("the engine's stream ended before the generation finished")
        return Generation(ids, logprobs, last.finish_reason, prompt_ids, last.cached_tokens, last.stop_reason)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        """`_serve`, in the rollout's trace (a span per call, its model calls under it) when tracing is on."""
        if self._trace is None or scope["type"] != "http":
            return await self._serve(scope, receive, send)
        with tracing.attached(self._trace), trace_spans.span(f"gateway {scope['method']} {scope['path'][:64]}",
                                                         {"http.route": scope["path"][:64]}):
            return await self._serve(scope, receive, send)

    async def _serve(self, scope: dict, receive: Any, send: Any) -> None:
        """The ASGI app: a plain path dispatch (a framework's middleware and routing cost more per call
        than the whole goal; FACTS and bench/results/RESULTS-gateway.md). A malformed request is a 4xx in the
        route's dialect, never a 500."""
        if scope["type"] != "http":
            return
        route = _ROUTES.get(scope["path"].rstrip("/"))
        wire = route[2] if route else (anthropic if scope["path"].startswith("/v1/messages") else chat)
        if route is None:
            return await respond(send, 404, wire.error(404, f"no route {scope['path']}", "not_found"))
        method, handler, wire = route
        if scope["method"] != method:
            return await respond(send, 405, wire.error(405, f"use {method}", "invalid_request_error"))
        if self._requests >= REQUESTS_IN_FLIGHT:
            return await respond(send, 429, wire.error(429, f"this rollout has {self._requests} calls in flight; the "
                                                       f"gateway takes at most {REQUESTS_IN_FLIGHT}", "rate_limit_error"))
        self._requests += 1
        try:
            request = await read_body(scope, receive)
            if request is None:
                return
            await handler(self, request, send)
        except Invalid as e:  # raised before anything is sent
            await respond(send, e.status, wire.error(e.status, str(e), e.error_type))
        finally:
            self._requests -= 1

    async def _encode(self, text: str) -> list[int]:
        if len(text) <= INLINE_CHARS:
            return self._pieces.encode(text)
        async with self._long_texts:  # a rollout's long texts one at a time: a harness cannot take every core
            return await asyncio.to_thread(self.tokenizer.encode_text_in_thread, text)

    async def _models(self, body: dict, send: Any) -> None:
        """Both SDKs' model list shapes in one (OpenAI: object/owned_by; Anthropic: type/display_name/has_more)."""
        entry = {"id": self.model, "object": "model", "type": "model", "owned_by": "rolloutd",
                 "display_name": self.model, "created": 0, "created_at": "1970-01-01T00:00:00Z"}
        await respond(send, 200, {"object": "list", "data": [entry], "has_more": False,
                                  "first_id": self.model, "last_id": self.model})

    async def _prompt_ids(self, prompt: Prompt) -> list[int]:
        if len(prompt.messages) > MAX_MESSAGES:
            raise Invalid(f"{len(prompt.messages)} messages: the gateway takes at most {MAX_MESSAGES} in one call")
        try:
            async with self._long_texts:  # the template off the node daemon's loop, one rendering at a time
                text = await asyncio.to_thread(self.tokenizer.render, prompt.messages, tools=prompt.tools,
                                               add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 - the template's own checks (roles, tool shapes) on the harness's input
            raise Invalid(f"the model's chat template cannot render these messages: {type(e).__name__}: {e}") from None
        return await self._encode(text)

    async def _count_tokens(self, body: dict, send: Any) -> None:
        ids = await self._prompt_ids(anthropic.parse(body, counting=True))
        await respond(send, 200, {"input_tokens": len(ids)})

    async def _dialect(self, wire: Dialect, body: dict, send: Any) -> None:
        """One model call in `wire`'s dialect: parsed to a `Prompt`, answered whole or streamed as it comes."""
        prompt = wire.parse(body)
        ids = await self._prompt_ids(prompt)
        if prompt.stream:
            return await self._stream(wire, prompt, ids, body, send)
        call = await self._call(ids, prompt, send, wire)
        if call is not None:
            turn = self._turn(self.tokenizer.decode_content(call.token_ids), call, prompt)
            await respond(send, 200, wire.reply(turn, self.model, body))

    def _turn(self, text: str, call: Call, prompt: Prompt) -> Turn:
        return make_turn(text, prompt, self.tools, finish_reason=call.finish_reason, stop_reason=call.stop_reason,
                         prompt_tokens=len(call.prompt_ids), completion_tokens=len(call.token_ids))

    async def _stream(self, wire: Dialect, prompt: Prompt, ids: list[int], body: dict, send: Any) -> None:
        """Server-sent events as the engine produces tokens. The response starts once the engine has taken the
        call (a call it refuses, or that fails before, is an ordinary error response); a failure after is the
        dialect's error event."""
        events = wire.Events(self.model, len(ids), body)
        deltas = TextDeltas(self.tokenizer.decode_content,
                            [*(self.tools.openers if prompt.tools and prompt.parse_tools else ()), *prompt.stop])
        started = False

        async def write(make: Any, more: bool = True) -> None:
            """Send `make()`'s events, the response's head and first events before them the first time."""
            nonlocal started
            head = b""
            if not started:
                started = True
                await send({"type": "http.response.start", "status": 200,
                            "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]})
                head = events.start()
            await send({"type": "http.response.body", "body": head + make(), "more_body": more})

        async def on_tokens(new: list[int]) -> None:
            delta = deltas.feed(new)
            if delta or not started:  # nothing to send (held back, half a character): no write, once started
                await write(lambda: events.text(delta))

        try:
            call = await self._call(ids, prompt, send, wire, on_tokens)
        except (BackendError, RequestRejected) as e:  # after the response started: the dialect's error event
            reason = str(e)
            return await write(lambda: events.failed(reason), more=False)
        if call is None:
            return
        turn = self._turn(self.tokenizer.decode_content(call.token_ids), call, prompt)
        await write(lambda: events.end(turn, deltas.rest(turn)), more=False)

    async def _completions(self, body: dict, send: Any) -> None:
        prompt = completion_prompt(body, getattr(self.tokenizer, "vocab_size", None))
        limit = max_tokens(body.get("max_tokens"))
        ids = await self._encode(prompt) if isinstance(prompt, str) else prompt
        call = await self._call(ids, Prompt([], max_tokens=limit), send, chat)
        if call is None:
            return
        await respond(send, 200, {"id": f"cmpl-{uuid.uuid4().hex[:12]}", "object": "text_completion",
                                  "created": int(time.time()), "model": self.model,
                                  "choices": [{"index": 0, "text": self.tokenizer.decode(call.token_ids),
                                               "finish_reason": call.finish_reason}],
                                  "usage": {"prompt_tokens": len(ids), "completion_tokens": len(call.token_ids),
                                            "total_tokens": len(ids) + len(call.token_ids)}})

    async def _call(self, prompt_ids: list[int], prompt: Prompt, send: Any, wire: Dialect,
                    on_tokens: Any = None) -> Call | None:
        """The engine call; a failure is recorded and answered in the dialect (502 infra, 400 the job's
        configuration) while nothing was sent yet, else re-raised for the stream's own error event. A prompt over
        the job's token budget is answered 400 here: the engine never sees it."""
        refused = self._over_budget(len(prompt_ids))
        if refused is not None:
            return await respond(send, 400, wire.error(400, refused, "invalid_request_error"))
        started = [False]

        async def tokens(new: list[int]) -> None:
            started[0] = True
            await on_tokens(new)
        try:
            return await self.generate(prompt_ids, prompt.max_tokens, prompt.stop, tokens if on_tokens else None)
        except BackendError as e:  # the harness sees a 502; the rollout's RUN reports it as infra
            self.backend_error = str(e)
            if started[0]:
                raise
            await respond(send, 502, wire.error(502, f"backend: {e}", "backend_error"))
        except RequestRejected as e:  # the prompt is checked above: the job's sampling fields; RUN reports config
            self.rejected = str(e)
            if started[0]:
                raise
            await respond(send, 400, wire.error(400, f"backend refused the request: {e}", "invalid_request_error"))
        return None

    def _over_budget(self, n: int) -> str | None:
        """Why a prompt of `n` tokens is refused (no room left in the job's budget for one generated token), recorded
        for the trajectory; None when it fits."""
        budget = self.max_total_tokens
        if budget is None or n < budget:
            return None
        reason = (f"spec.agent.sampling.maxTotalTokens: this prompt has {n} tokens, "
                  f"{'more than' if n > budget else 'as many as'} the job's token budget of {budget} (prompt and "
                  f"generation together); it was not sent to the model")
        if self.over_budget is None:
            self.over_budget, self.over_budget_first = reason, not self.calls
        return reason


def _served(wire: Dialect) -> Callable[[Gateway, dict, Any], Awaitable[None]]:
    async def serve(gateway: Gateway, body: dict, send: Any) -> None:
        await gateway._dialect(wire, body, send)
    return serve


# Every dialect of agents/wire/dialect.py's table at its path, and the routes of no dialect of their own.
_ROUTES = {**{path: ("POST", _served(wire), wire) for path, wire in DIALECTS.items()},
           "/v1/models": ("GET", Gateway._models, chat), "/v1/completions": ("POST", Gateway._completions, chat),
           "/v1/messages/count_tokens": ("POST", Gateway._count_tokens, anthropic)}


__all__ = ["Call", "Gateway", "PieceEncoder", "RELAY", "Segment", "start_relay", "stitch"]
