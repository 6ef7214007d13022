"""vLLM's HTTP client, `VLLMBackend`: the `LLMBackend` (agents/llm.py) each backend URL gets on a node.

Where it sits: the daemon's pipeline (agents/daemon/pipeline.py) builds one per backend URL and shares it between
rollouts; each rollout calls it through its `daemon.llmgate.TrackedLLM`, and its answers go on as `Generation`s
(a context overflow a truncated ending; failures raised as agents/llm.py's classes).

Plain-http backends go through `KeepAliveTransport` (agents/keepalive.py): httpx's default pool
costs 1–3 ms of CPU per request at the 32–64 connections a daemon keeps to one backend.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import math
import re
from collections.abc import AsyncIterator
from typing import Any

import httpx

from rolloutd.agents import vllm_tokens
from rolloutd.agents.keepalive import KeepAliveTransport, http_proxy_configured
from rolloutd.agents.llm import BackendError, Generation, Preempted, RequestRejected
from rolloutd.agents.sampling import SamplingParams
from rolloutd.crds.node import ENGINE_CLIENT_KEEP_ALIVE_SECONDS as KEEP_ALIVE


def _joined(pieces: list[Generation]) -> Generation:
    """Streamed pieces that arrived together, as one: their ids and logprobs in order, the last one's finish."""
    last = pieces[-1]
    return Generation([i for p in pieces for i in p.token_ids], [x for p in pieces for x in p.logprobs],
                      last.finish_reason,
                      next((p.prompt_token_ids for p in pieces if p.prompt_token_ids is not None), None),
                      next((p.cached_tokens for p in reversed(pieces) if p.cached_tokens is not None), None),
                      last.stop_reason, weight_spans=last.weight_spans)


_OVERFLOW = re.compile(r"maximum context length|context length|max_model_len|too long", re.I)


class VLLMBackend:
    """vLLM's OpenAI-compatible server (`/v1/completions` with a token-id prompt; streamed calls through its token
    endpoint instead when it serves one and labels its weights: `stamps`, see agents/vllm_tokens.py).

    `model` is discovered from `/v1/models` when not given (with its `max_model_len`, used to
    clamp `max_tokens` so a long conversation ends as `length` instead of a 400). `timeout` bounds
    one request end to end.
    """

    def __init__(
        self,
        url: str,
        model: str | None = None,
        *,
        timeout: float = 600.0,
        connect_timeout: float = 10.0,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.model = model
        self.max_model_len: int | None = None
        self.timeout = timeout
        # plain http through KeepAliveTransport (module docstring) unless a proxy is set (httpx's transports honour it)
        mounts = None if http_proxy_configured() else {"http://": KeepAliveTransport(
            max_connections=256, max_keepalive=64, keepalive_expiry=KEEP_ALIVE)}
        self._timeout = httpx.Timeout(timeout, connect=connect_timeout)
        self._client = client or httpx.AsyncClient(
            timeout=self._timeout,
            limits=httpx.Limits(max_connections=256, max_keepalive_connections=64, keepalive_expiry=KEEP_ALIVE),
            mounts=mounts,
        )
        self._owns_client = client is None
        # plain http through our own pool: requests go to it straight, not through the client's layers (URL and
        # header merging, auth, redirects, cookies: ~6 % of a daemon's CPU with an instant LLM; none applies here)
        self._direct = mounts["http://"] if client is None and mounts and self.url.startswith("http://") else None
        self._discover_lock = asyncio.Lock()
        self._discovered = False
        self.stamps: bool | None = None  # streams go to the token endpoint, stamped (None: not probed yet)

    async def aclose(self) -> None:
        if self._owns_client:
            await self._client.aclose()

    async def __aenter__(self) -> "VLLMBackend":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _request(self, method: str, path: str, *, preempt: bool = False, **kw: Any) -> httpx.Response:
        try:
            resp = await self._send(method, f"{self.url}{path}", **kw)
        except httpx.ConnectTimeout as e:
            raise BackendError(f"{self.url}{path}: connect timed out", unreachable=True) from e
        except httpx.TimeoutException as e:
            raise BackendError(f"{self.url}{path}: timed out ({type(e).__name__})") from e
        except httpx.HTTPError as e:  # connect refused, reset, closed mid-response, ...
            # the kind only: an exception's text can quote what the server sent (a malformed status line)
            raise BackendError(f"{self.url}{path}: {type(e).__name__}",
                               unreachable=isinstance(e, httpx.TransportError)) from e
        if preempt and resp.status_code == 503:  # paused (a weight update): nothing generated
            raise Preempted(f"{self.url}{path}: HTTP 503", Generation([], [], "abort"))
        if resp.status_code >= 500:  # a status, never the body (the URL may be any service the node reaches)
            raise BackendError(f"{self.url}{path}: HTTP {resp.status_code}")
        return resp

    async def _send(self, method: str, url: str, *, json: Any = None, timeout: float | None = None) -> httpx.Response:
        if self._direct is None:
            return await self._client.request(method, url, json=json,
                                              timeout=httpx.USE_CLIENT_DEFAULT if timeout is None else timeout)
        t = self._timeout if timeout is None else httpx.Timeout(timeout)
        request = httpx.Request(method, url, json=json, extensions={"timeout": t.as_dict()})
        resp = await self._direct.handle_async_request(request)
        resp.request = request
        return resp

    async def discover(self) -> str:
        """Fill `model` and `max_model_len` from /v1/models (once)."""
        if self._discovered and self.model is not None:
            return self.model
        async with self._discover_lock:
            if self._discovered and self.model is not None:
                return self.model
            resp = await self._request("GET", "/v1/models")
            if resp.status_code != 200:
                raise BackendError(f"{self.url}/v1/models: HTTP {resp.status_code}")
            try:
                data = resp.json().get("data") or []
            except (ValueError, AttributeError):
                raise BackendError(f"{self.url}/v1/models: not a model list") from None
            if not data:
                raise BackendError(f"{self.url} serves no model")
            entry = next((d for d in data if d.get("id") == self.model), data[0]) if self.model else data[0]
            self.model = self.model or entry["id"]
            self.max_model_len = entry.get("max_model_len")
            self._discovered = True
            return self.model

    async def _probe_stamps(self) -> bool:
        """Once: does the engine serve its token endpoint and label its weights (agents/vllm_tokens.py)?"""
        if self.stamps is None:
            with contextlib.suppress(BackendError):  # else asked again next time
                self.stamps = await vllm_tokens.served(self._request, self.model)
        return bool(self.stamps)

    async def paused(self) -> bool:
        """Whether the engine is paused now (a weight update: agents/vllm_tokens.py)."""
        return await vllm_tokens.paused(self._request)

    async def _body(self, prompt_ids: list[int], sampling: SamplingParams, request_id: str) -> dict | None:
        """The /v1/completions body; None when nothing fits in the context (a truncated ending)."""
        model = await self.discover()
        max_tokens = sampling.max_tokens
        if self.max_model_len is not None:
            room = self.max_model_len - len(prompt_ids)
            if room <= 0:
                return None
            max_tokens = min(max_tokens, room)
        return {**sampling.request_fields(), "model": model, "prompt": list(prompt_ids), "max_tokens": max_tokens,
                "logprobs": 0, "return_token_ids": True, "return_tokens_as_token_ids": True,
                "skip_special_tokens": False, "request_id": request_id}

    def _refused(self, status: int, text: str) -> bool:
        """A non-200 answer: True for a context overflow (a truncated ending), else raises."""
        if status == 400 and _OVERFLOW.search(text):
            return True
        if status in (400, 404, 422):
            raise RequestRejected(f"{self.url}/v1/completions: HTTP {status}: {vllm_tokens.engine_message(text)}")
        raise BackendError(f"/v1/completions: HTTP {status}")

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, request_id: str, *,
                       stamped: bool = False) -> Generation:
        """One plain request to /v1/completions, or (`stamped`: an engine that stamps, `stamps`) to the token endpoint,
        whose answer carries the stamps; aborted (or refused, paused), it raises Preempted with the tokens so far."""
        body = await self._body(prompt_ids, sampling, request_id)
        if body is None:
            return Generation([], [], "length", list(prompt_ids), None)
        try:
            resp = await (self._request("POST", vllm_tokens.GENERATE, json=vllm_tokens.body(
                prompt_ids, body, request_id, body["model"], stream=False), preempt=True) if stamped
                else self._request("POST", "/v1/completions", json=body))
        except asyncio.CancelledError:
            # the rollout was cancelled: stop the work on the server too, not just the wait
            with contextlib.suppress(Exception):
                await asyncio.shield(self.abort(request_id))
            raise
        if resp.status_code != 200:
            self._refused(resp.status_code, resp.text)
            return Generation([], [], "length", list(prompt_ids), None)
        try:
            data = resp.json()
        except ValueError:
            raise BackendError("malformed completion response: not JSON") from None
        return self._stamped(data) if stamped else self._parse(data, prompt_ids)

    async def stream(self, prompt_ids: list[int], sampling: SamplingParams,
                     request_id: str) -> AsyncIterator[Generation]:
        """`generate`, streamed (`stream: true`): a first empty piece once the engine has taken the request (its
        response started: the caller may start its own), then pieces holding the ids and logprobs vLLM sent (the
        engine's own, as token ids) in the chunks one read of the socket brought (one chunk while the reader keeps
        up; several, joined, when it fell behind), the last one the finish reason. Failures as `generate`'s."""
        body = await self._body(prompt_ids, sampling, request_id)
        if body is None:
            yield Generation([], [], "length", list(prompt_ids), None)
            return
        stamped = await self._probe_stamps()
        url = f"{self.url}{vllm_tokens.GENERATE if stamped else '/v1/completions'}"
        finished = False
        resp: httpx.Response | None = None
        try:
            resp = await self._open_stream(url, vllm_tokens.body(prompt_ids, body, request_id, body["model"])
                                           if stamped else {**body, "stream": True})
            if resp.status_code == 503:  # paused (a weight update): nothing generated
                raise Preempted(f"{url}: HTTP 503", Generation([], [], "abort"))
            if resp.status_code != 200:
                self._refused(resp.status_code, (await resp.aread()).decode(errors="replace"))
                yield Generation([], [], "length", list(prompt_ids), None)
                return
            yield Generation([], [], "", None, None)  # the engine took the request: its stream has started
            tail, done = b"", False
            async for data in resp.aiter_bytes():  # what one read of the socket gave: maybe several chunks
                *lines, tail = (tail + data).split(b"\n")
                pieces = []
                for line in lines:
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        done = True
                        break
                    try:
                        chunk = json.loads(payload)
                    except ValueError:
                        raise BackendError("malformed completion stream: not JSON") from None
                    if not isinstance(chunk, dict) or "error" in chunk:
                        raise BackendError("the engine failed the request mid-stream")
                    if chunk.get("choices"):  # else a usage-only chunk
                        pieces.append(self._stamped(chunk) if stamped else self._parse(chunk, prompt_ids, partial=True))
                if pieces:  # the chunks that came together go on as one piece
                    piece = pieces[0] if len(pieces) == 1 else _joined(pieces)
                    finished = finished or bool(piece.finish_reason)
                    yield piece
                if done:
                    break
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await asyncio.shield(self.abort(request_id))
            raise
        except httpx.TimeoutException as e:
            raise BackendError(f"{url}: timed out ({type(e).__name__})",
                               unreachable=isinstance(e, httpx.ConnectTimeout)) from e
        except httpx.HTTPError as e:
            raise BackendError(f"{url}: {type(e).__name__}", unreachable=isinstance(e, httpx.ConnectError)) from e
        finally:
            if resp is not None:
                with contextlib.suppress(Exception):
                    await resp.aclose()  # a stream not read to its end closes its connection (vLLM aborts)
        if not finished:
            raise BackendError("the engine's stream ended before the generation finished")

    async def _open_stream(self, url: str, body: dict) -> httpx.Response:
        """A streamed POST: through our own pool (its "stream" extension) on plain http, else the client's."""
        if self._direct is None:
            return await self._client.send(self._client.build_request("POST", url, json=body), stream=True)
        request = httpx.Request("POST", url, json=body, extensions={"timeout": self._timeout.as_dict(), "stream": True})
        resp = await self._direct.handle_async_request(request)
        resp.request = request
        return resp

    @staticmethod
    def _stamped(chunk: dict[str, Any]) -> Generation:
        try:  # the token endpoint's answer, or a chunk of its stream (the last one with the engine's weight stamps)
            ids, logprobs, finish, stop_reason, spans = vllm_tokens.parse(chunk)
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise BackendError(f"malformed token stream ({type(e).__name__})") from e
        if finish == "abort":  # dropped server-side (pause for weight sync, abort): retry, never score
            raise Preempted("request aborted by the server", Generation(ids, logprobs, "abort", weight_spans=spans))
        return Generation(ids, logprobs, finish, None, vllm_tokens.cached_tokens(chunk), stop_reason,
                          weight_spans=spans)

    @staticmethod
    def _parse(data: dict[str, Any], prompt_ids: list[int], partial: bool = False) -> Generation:
        """A completion (or, `partial`, one chunk of a streamed one: its finish reason "" until the last)."""
        try:
            choice = data["choices"][0]
            ids = [int(i) for i in (choice.get("token_ids") or [] if partial else choice["token_ids"])]
            lp = choice.get("logprobs") or {}
            logprobs = lp.get("token_logprobs") or []
            tokens = lp.get("tokens") or []
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise BackendError(f"malformed completion response ({type(e).__name__})") from e
        finish = choice.get("finish_reason") or ("" if partial else "stop")
        if len(logprobs) != len(ids):
            raise BackendError(f"{len(logprobs)} logprobs for {len(ids)} generated ids")
        if finish == "abort":  # dropped server-side (pause for weight sync, abort): retry, never score
            raise Preempted("request aborted by the server", Generation(
                ids, [float(x) if x is not None else -math.inf for x in logprobs], "abort"))
        if tokens and tokens != [f"token_id:{i}" for i in ids]:
            raise BackendError("logprob tokens do not match the generated ids")
        returned_prompt = choice.get("prompt_token_ids")
        if returned_prompt is not None and list(returned_prompt) != list(prompt_ids):
            raise BackendError("the engine did not use the prompt ids as sent")
        logprobs = [float(x) if x is not None else -math.inf for x in logprobs]
        return Generation(ids, logprobs, finish, returned_prompt, vllm_tokens.cached_tokens(data),
                          choice.get("stop_reason"))

    async def wait_healthy(self, timeout: float, every: float = 1.0) -> bool:
        """Poll `/health` until it answers 200 (True) or `timeout` seconds pass (False)."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            with contextlib.suppress(BackendError):
                if (await self._request("GET", "/health", timeout=min(every * 5, 10.0))).status_code == 200:
                    return True
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                return False
            await asyncio.sleep(min(every, left))

    async def abort(self, request_id: str) -> None:
        """Abort a running request server-side (needs VLLM_SERVER_DEV_MODE=1; best effort).

        The engine knows request R as `cmpl-R-0` (completions: choice 0, we send one) or `generate-tokens-R` (the
        token endpoint) in vllm 0.32."""
        ids = [f"cmpl-{request_id}-0", request_id, *vllm_tokens.engine_ids(request_id)]
        with contextlib.suppress(BackendError):
            await self._request("POST", "/abort_requests", json={"request_ids": ids}, timeout=10.0)
