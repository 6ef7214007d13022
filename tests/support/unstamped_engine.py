"""A real vLLM engine seen as one without weight stamps: a streaming reverse proxy that answers 404 for the token
endpoint and the weight-label calls (an engine started without `--enable-scale-out`, or an older vLLM) and passes
everything else through, streams included. Used by tests/e2e/test_async_updates.py (keep mode on such an engine).
"""
from __future__ import annotations

import httpx

from rolloutd.agents import vllm_tokens

from support.ports import free_port
from support.serve_thread import ThreadServer

HIDDEN = (vllm_tokens.PROBE, "/inference/v1/generate", "/weight_info", "/update_weight_version")


class UnstampedEngine:
    """`with UnstampedEngine(engine.url) as url:` the engine behind a proxy at `url`."""

    def __init__(self, upstream: str) -> None:
        self.upstream, self.port = upstream.rstrip("/"), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.hidden: list[str] = []  # the hidden paths asked, in order

    async def app(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] in HIDDEN:
            self.hidden.append(scope["path"])
            await send({"type": "http.response.start", "status": 404, "headers": [(b"content-type", b"text/plain")]})
            await send({"type": "http.response.body", "body": b"Not Found"})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in (b"host", b"content-length")]
        query = f"?{scope['query_string'].decode()}" if scope["query_string"] else ""
        async with httpx.AsyncClient(timeout=None) as client:
            async with client.stream(scope["method"], f"{self.upstream}{scope['path']}{query}", content=body,
                                     headers=headers) as r:
                await send({"type": "http.response.start", "status": r.status_code,
                            "headers": [(k.encode(), v.encode()) for k, v in r.headers.items()
                                        if k.lower() not in ("content-length", "transfer-encoding", "connection")]})
                async for chunk in r.aiter_raw():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    def __enter__(self) -> str:
        self._server = ThreadServer(self.app, self.port, "unstamped-engine proxy", interface="asgi3").start()
        return self.url

    def __exit__(self, *exc) -> None:
        self._server.stop()
