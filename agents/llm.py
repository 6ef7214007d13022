"""The token-in/token-out LLM client: one `LLMBackend` interface, one vLLM implementation.

Where it sits: the agent loop (agents/loop.py) calls `generate(prompt_ids, sampling, request_id)`
once per turn on the backend the scheduler pinned to the task, and `abort(request_id)` when the
rollout is cancelled (DAPO surplus, job deleted). The daemon builds one `VLLMBackend` per backend
URL and shares it between rollouts.

Failure classes: `BackendError` is an *infrastructure* failure (timeout, connection loss, 5xx, a
request the server dropped): the rollout is retried or excluded, never scored. A context overflow
is not an error: it is a normal truncated ending (`finish_reason="length"`, possibly no tokens).

Plain-http backends go through `KeepAliveTransport`, a small keep-alive pool under httpx (h11 on
asyncio streams): httpx's default pool (httpcore 1.0) rescans every pooled connection — with a
syscall each — on every request, which costs 1–3 ms of CPU per request at the 32–64 connections a
daemon keeps to one backend, and its locks retry a failing `import sniffio` each time. https and
proxied backends keep httpx's default transport.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import math
import re
import time
import urllib.request
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import h11  # httpx's own HTTP/1.1 parser (through httpcore), used by KeepAliveTransport
import httpx
from pydantic import BaseModel, ConfigDict, Field


class SamplingParams(BaseModel):
    """The job's sampling parameters. Every field that is set is sent to the engine; None = the
    engine's default. `seed` is the job's base seed (see `derive_seed`)."""

    model_config = ConfigDict(extra="forbid")

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float | None = None
    max_tokens: int = 256
    min_tokens: int | None = None
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None

    def request_fields(self) -> dict[str, Any]:
        """The /v1/completions fields for these parameters (unset optional fields left out)."""
        body = self.model_dump(exclude_none=True)
        for key in ("stop", "stop_token_ids"):
            if not body.get(key):
                body.pop(key, None)
        return body


def derive_seed(base: int | None, *parts: int | str) -> int | None:
    """A deterministic per-request seed from the job's base seed and (prompt, sample, turn):
    distinct samples of a group get distinct streams, a rerun of the job gets the same ones."""
    if base is None:
        return None
    digest = hashlib.sha256(":".join(map(str, (base, *parts))).encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


@dataclass
class Generation:
    """One turn's output: exactly the generated ids, one logprob per id."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    prompt_token_ids: list[int] | None = None
    cached_tokens: int | None = None
    stop_reason: int | str | None = None


class BackendError(Exception):
    """Infrastructure failure talking to an LLM backend (never a reward)."""


@runtime_checkable
class LLMBackend(Protocol):
    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, request_id: str) -> Generation: ...

    async def abort(self, request_id: str) -> None: ...


class _Conn:
    """One keep-alive HTTP/1.1 connection (asyncio streams + an h11 state machine)."""

    __slots__ = ("reader", "writer", "h11", "idle_since")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.h11 = h11.Connection(h11.CLIENT)
        self.idle_since = 0.0

    def reusable(self, now: float, expiry: float) -> bool:
        """Still open (the server has not closed it while idle) and not idle for too long."""
        return not self.writer.is_closing() and not self.reader.at_eof() and now - self.idle_since < expiry

    def close(self) -> None:
        self.writer.close()


class KeepAliveTransport(httpx.AsyncBaseTransport):
    """A minimal keep-alive connection pool for plain-http requests whose bodies are read whole
    (what `VLLMBackend` sends): one request per connection at a time, idle connections kept per
    origin (at most `max_keepalive`, closed after `keepalive_expiry` s idle: under uvicorn's 5 s),
    at most `max_connections` open. A connection is reused only after a complete exchange; an
    error or a cancellation mid-request closes it (the server sees the disconnect). Errors are
    httpx's (`ConnectError`, `ReadTimeout`, `RemoteProtocolError`, ...), timeouts httpx's
    per-request `connect`/`read`/`write`/`pool` values."""

    def __init__(self, *, max_connections: int = 256, max_keepalive: int = 64, keepalive_expiry: float = 4.0) -> None:
        self.max_keepalive, self.keepalive_expiry = max_keepalive, keepalive_expiry
        self._idle: dict[tuple[str, int], list[_Conn]] = collections.defaultdict(list)
        self._slots = asyncio.Semaphore(max_connections)
        self._closed = False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        if url.scheme != "http":
            raise httpx.UnsupportedProtocol(f"KeepAliveTransport speaks plain http only, not {url.scheme}://")
        timeouts = request.extensions.get("timeout", {})
        body = await request.aread()
        try:
            async with asyncio.timeout(timeouts.get("pool")):
                await self._slots.acquire()
        except TimeoutError:
            raise httpx.PoolTimeout("no free connection slot", request=request) from None
        conn: _Conn | None = None
        reusable = False
        try:
            conn = await self._connect(request, (url.host, url.port or 80), timeouts.get("connect"))
            c = conn.h11
            try:
                out = c.send(h11.Request(method=request.method, target=url.raw_path, headers=request.headers.raw))
                if body:
                    out += c.send(h11.Data(data=body))
                out += c.send(h11.EndOfMessage())
            except h11.LocalProtocolError as e:
                raise httpx.LocalProtocolError(str(e), request=request) from None
            conn.writer.write(out)
            try:
                async with asyncio.timeout(timeouts.get("write")):
                    await conn.writer.drain()
            except TimeoutError:
                raise httpx.WriteTimeout("timed out sending the request", request=request) from None
            except OSError as e:
                raise httpx.WriteError(f"{type(e).__name__}: {e}", request=request) from None
            response, chunks = None, []
            while True:
                try:
                    event = c.next_event()
                except h11.RemoteProtocolError as e:
                    raise httpx.RemoteProtocolError(str(e), request=request) from None
                if event is h11.NEED_DATA:
                    try:
                        async with asyncio.timeout(timeouts.get("read")):
                            data = await conn.reader.read(65536)
                    except TimeoutError:
                        raise httpx.ReadTimeout("timed out waiting for the response", request=request) from None
                    except OSError as e:
                        raise httpx.ReadError(f"{type(e).__name__}: {e}", request=request) from None
                    if not data and response is None:
                        raise httpx.RemoteProtocolError("Server disconnected without sending a response.",
                                                        request=request)
                    try:
                        c.receive_data(data)
                    except h11.RemoteProtocolError as e:
                        raise httpx.RemoteProtocolError(str(e), request=request) from None
                elif isinstance(event, h11.Response):
                    response = event
                elif isinstance(event, h11.Data):
                    chunks.append(bytes(event.data))
                elif isinstance(event, h11.EndOfMessage):
                    break
                elif isinstance(event, h11.ConnectionClosed):
                    raise httpx.RemoteProtocolError("Server disconnected without sending a response.",
                                                    request=request)
            reusable = c.our_state is h11.DONE and c.their_state is h11.DONE
            if reusable:
                c.start_next_cycle()
        finally:
            self._slots.release()
            if conn is not None:
                idle = self._idle[(url.host, url.port or 80)]
                if reusable and not self._closed and len(idle) < self.max_keepalive:
                    conn.idle_since = time.monotonic()
                    idle.append(conn)
                else:
                    conn.close()
        assert response is not None
        return httpx.Response(response.status_code, headers=response.headers, content=b"".join(chunks),
                              extensions={"http_version": b"HTTP/1.1", "reason_phrase": response.reason})

    async def _connect(self, request: httpx.Request, origin: tuple[str, int], timeout: float | None) -> _Conn:
        idle, now = self._idle[origin], time.monotonic()
        while idle:  # the most recently used first: the least likely to have been closed
            conn = idle.pop()
            if conn.reusable(now, self.keepalive_expiry):
                return conn
            conn.close()
        try:
            async with asyncio.timeout(timeout):
                reader, writer = await asyncio.open_connection(*origin, limit=1 << 20)
        except TimeoutError:
            raise httpx.ConnectTimeout(f"timed out connecting to {origin[0]}:{origin[1]}", request=request) from None
        except OSError as e:
            raise httpx.ConnectError(f"{type(e).__name__}: {e}", request=request) from None
        return _Conn(reader, writer)

    async def aclose(self) -> None:
        self._closed = True
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()


def _http_proxy_configured() -> bool:
    proxies = urllib.request.getproxies()
    return bool(proxies.get("http") or proxies.get("all"))


_OVERFLOW = re.compile(r"maximum context length|context length|max_model_len|too long", re.I)


class VLLMBackend:
    """vLLM's OpenAI-compatible server (`/v1/completions` with a token-id prompt).

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
        # plain http to the backends through KeepAliveTransport (see the module docstring), unless
        # the environment routes http through a proxy (httpx's own transports honour it)
        mounts = None if _http_proxy_configured() else {"http://": KeepAliveTransport(max_connections=256,
                                                                                       max_keepalive=64)}
        self._client = client or httpx.AsyncClient(
            timeout=httpx.Timeout(timeout, connect=connect_timeout),
            limits=httpx.Limits(max_connections=256, max_keepalive_connections=64),
            mounts=mounts,
        )
        self._owns_client = client is None
        self._discover_lock = asyncio.Lock()
        self._discovered = False

    async def aclose(self) -> None:
        if self._owns_client:
            await self._client.aclose()

    async def __aenter__(self) -> "VLLMBackend":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        try:
            resp = await self._client.request(method, f"{self.url}{path}", **kw)
        except httpx.TimeoutException as e:
            raise BackendError(f"{self.url}{path}: timed out ({type(e).__name__})") from e
        except httpx.HTTPError as e:  # connect refused, reset, closed mid-response, ...
            raise BackendError(f"{self.url}{path}: {type(e).__name__}: {e}") from e
        if resp.status_code >= 500:
            raise BackendError(f"{self.url}{path}: HTTP {resp.status_code}: {resp.text[:500]}")
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
                raise BackendError(f"{self.url}/v1/models: HTTP {resp.status_code}: {resp.text[:300]}")
            data = resp.json().get("data") or []
            if not data:
                raise BackendError(f"{self.url} serves no model")
            entry = next((d for d in data if d.get("id") == self.model), data[0]) if self.model else data[0]
            self.model = self.model or entry["id"]
            self.max_model_len = entry.get("max_model_len")
            self._discovered = True
            return self.model

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, request_id: str) -> Generation:
        model = await self.discover()
        max_tokens = sampling.max_tokens
        if self.max_model_len is not None:
            room = self.max_model_len - len(prompt_ids)
            if room <= 0:  # nothing fits: a truncated ending, not an error
                return Generation([], [], "length", list(prompt_ids), None)
            max_tokens = min(max_tokens, room)
        body = {
            **sampling.request_fields(),
            "model": model,
            "prompt": list(prompt_ids),
            "max_tokens": max_tokens,
            "logprobs": 0,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "skip_special_tokens": False,
            "request_id": request_id,
        }
        try:
            resp = await self._request("POST", "/v1/completions", json=body)
        except asyncio.CancelledError:
            # the rollout was cancelled: stop the work on the server too, not just the wait
            with contextlib.suppress(Exception):
                await asyncio.shield(self.abort(request_id))
            raise
        if resp.status_code != 200:
            text = resp.text
            if resp.status_code == 400 and _OVERFLOW.search(text):
                return Generation([], [], "length", list(prompt_ids), None)
            raise BackendError(f"/v1/completions: HTTP {resp.status_code}: {text[:500]}")
        return self._parse(resp.json(), prompt_ids)

    @staticmethod
    def _parse(data: dict[str, Any], prompt_ids: list[int]) -> Generation:
        try:
            choice = data["choices"][0]
            ids = [int(i) for i in choice["token_ids"]]
            lp = choice.get("logprobs") or {}
            logprobs = lp.get("token_logprobs") or []
            tokens = lp.get("tokens") or []
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise BackendError(f"malformed completion response: {e!r}: {str(data)[:300]}") from e
        finish = choice.get("finish_reason") or "stop"
        if finish == "abort":  # dropped server-side (pause for weight sync, abort): retry, never score
            raise BackendError("request aborted by the server")
        if len(logprobs) != len(ids):
            raise BackendError(f"{len(logprobs)} logprobs for {len(ids)} generated ids")
        if tokens and tokens != [f"token_id:{i}" for i in ids]:
            raise BackendError("logprob tokens do not match the generated ids")
        returned_prompt = choice.get("prompt_token_ids")
        if returned_prompt is not None and list(returned_prompt) != list(prompt_ids):
            raise BackendError("the engine did not use the prompt ids as sent")
        logprobs = [float(x) if x is not None else -math.inf for x in logprobs]
        usage = data.get("usage") or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        return Generation(ids, logprobs, finish, returned_prompt, cached, choice.get("stop_reason"))

    async def abort(self, request_id: str) -> None:
        """Abort a running request server-side (needs VLLM_SERVER_DEV_MODE=1; best effort).

        The completions endpoint registers choice i of request R as `cmpl-R-i` in the engine
        (vllm 0.32, entrypoints/openai/completion/serving.py); we send one choice per request."""
        ids = [f"cmpl-{request_id}-0", request_id]
        with contextlib.suppress(BackendError):
            await self._request("POST", "/abort_requests", json={"request_ids": ids}, timeout=10.0)
