"""The backends' health: every known backend's /health probed, and each engine's sizes learned from /server_info.

The scheduler's background loop runs `HealthProbe.check`, which marks each backend healthy or not in
`backends.BackendPool` and tells `admission` the engine's `max_num_seqs` and KV cache in tokens (`engine_sizes`;
`kv_tokens` reads them once, for benches and tests).
"""
from __future__ import annotations

import asyncio
import threading
from typing import Any, Awaitable, Callable

import httpx

from .backend_http import BackendHttp, failure
from .backends import BackendPool


def _at(tree: Any, *keys: str) -> Any:
    for key in keys:
        tree = tree.get(key) if isinstance(tree, dict) else None
    return tree


def _positive(n: Any) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n > 0


def engine_sizes(config: Any) -> tuple[int | None, int | None]:
    """From vLLM's `/server_info` `vllm_config`: its `max_num_seqs` and its KV cache in tokens
    (`cache_config.num_gpu_blocks × block_size`, the token share's budget); None where it does not say."""
    seqs, cache = _at(config, "scheduler_config", "max_num_seqs"), _at(config, "cache_config")
    blocks, size = _at(cache, "num_gpu_blocks"), _at(cache, "block_size")
    return (seqs if _positive(seqs) else None,
            blocks * size if _positive(blocks) and _positive(size) else None)


def kv_tokens(url: str, timeout: float = 30.0) -> int | None:
    """The engine's KV cache in tokens, read once and synchronously (benches and tests that stand for the health
    probe); None when the engine does not say (not in dev mode, not vLLM, not reachable)."""
    try:
        r = httpx.get(f"{url}/server_info", params={"config_format": "json"}, timeout=timeout)
        return engine_sizes(r.json()["vllm_config"])[1] if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None


class HealthProbe:
    """Probes every known backend's /health and marks it healthy or not in the pool.

    A backend that refuses or errors is unhealthy at once; one that only answers /health too
    slowly is busy, not dead (vLLM's API server can stall while it streams a fast generation),
    and is declared unhealthy only once it has been unanswering for `slow_grace` seconds.
    `check` (a test seam) replaces the HTTP probe: url → truthy when healthy."""

    def __init__(self, pool: BackendPool, http: BackendHttp, clock: Callable[[], float], *,
                 check: Callable[[str], Awaitable[Any]] | None = None, timeout: float = 3.0,
                 slow_grace: float = 20.0) -> None:
        self.pool, self.http, self.clock, self._check = pool, http, clock, check
        self.timeout, self.slow_grace = timeout, slow_grace
        self._slow_since: dict[str, float] = {}
        self._asked: dict[str, int] = {}  # url → /server_info calls that got no answer
        self._loop: asyncio.AbstractEventLoop | None = None  # the probes' own (see `check`)

    async def _probe(self, url: str) -> tuple[str, bool, str]:
        if self._check is not None:
            ok = await self._check(url)
            if ok and url not in self.pool.admission.reported:
                self.pool.admission.learned(url, None)  # a test seam: nothing to ask
            return url, bool(ok), "" if ok else "health check failed"
        try:
            r = await self.http.client.get(url + "/health", timeout=self.timeout)
        except httpx.TimeoutException:
            now = self.clock()
            since = self._slow_since.setdefault(url, now)
            if now - since < self.slow_grace:
                return url, self.pool.healthy(url), ""  # busy: keep its state for now
            return url, False, f"/health unanswered for {now - since:.0f}s"
        except httpx.HTTPError as e:
            self._slow_since.pop(url, None)
            return url, False, f"/health: {failure(e)}"
        self._slow_since.pop(url, None)
        if r.status_code == 200 and url not in self.pool.admission.reported:
            await self._learn_max_num_seqs(url)
        return url, r.status_code == 200, f"HTTP {r.status_code}"

    async def _learn_max_num_seqs(self, url: str) -> None:
        """The engine's `max_num_seqs` and KV cache in tokens (`cache_config.num_gpu_blocks × block_size`, the token
        share's budget: `tokenshare.budget`), which vLLM reports only on `/server_info` (VLLM_SERVER_DEV_MODE=1,
        as `rolloutd serve-model` runs it); None when it does not say (the admission falls back). An answer
        that does not come (its first call collects the engine's environment: slow) is asked again at the
        next probe, three times at most."""
        try:
            r = await self.http.client.get(url + "/server_info", params={"config_format": "json"},
                                           timeout=max(self.timeout, 10.0))
        except httpx.HTTPError:
            self._asked[url] = self._asked.get(url, 0) + 1
            if self._asked[url] >= 3:
                self.pool.admission.learned(url, None)
            return
        self._asked.pop(url, None)
        try:
            config = r.json()["vllm_config"] if r.status_code == 200 else {}
        except (ValueError, KeyError, TypeError):
            config = {}
        self.pool.admission.learned(url, *engine_sizes(config))

    async def check(self) -> list[tuple[str, bool, str]]:
        """Probe all backends at once; returns those whose health changed (url, healthy, why).

        The HTTP probes run on an event loop of their own, in a thread: on the controller's loop, when it
        was merely slow (a thousand nodes' calls queued), a backend's answer waited behind them until its
        timeout fired, and after `slow_grace` every backend was declared down, which stops all leasing.
        (The thread only sets single dict entries — the slow clock, a learned max_num_seqs — which the
        GIL keeps whole; health itself is set here, on the controller's loop.)"""
        urls = self.pool.known()
        if not urls:
            return []
        if self._check is not None:  # the test seam: no HTTP, no thread
            results = await asyncio.gather(*(self._probe(u) for u in urls))
        else:
            results = await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._probe_all(urls),
                                                                                 self._own_loop()))
        return [(url, ok, why) for url, ok, why in results if self.pool.set_health(url, ok, why)]

    async def _probe_all(self, urls: set[str]) -> list[tuple[str, bool, str]]:
        return await asyncio.gather(*(self._probe(u) for u in urls))

    def _own_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            threading.Thread(target=self._loop.run_forever, name="rolloutd-health", daemon=True).start()
        return self._loop

    def close(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop = None
