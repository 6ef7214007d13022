"""The LLM backends: the min-heap of in-flight tasks, health probing, and vLLM's admin calls.

`queue` pins a backend at lease time (`BackendPool.acquire`, within `admission`'s caps) and releases it when a
task leaves RUN; the scheduler's background loop runs `HealthProbe.check`; `policy` drives `BackendHttp.update`.
Unlike the seed system's heap, the key is the number of tasks *currently* pinned (not cumulative
assignments), unhealthy backends are skipped, and backends can be added and removed while jobs
run. Counts are global per URL: two jobs sharing a vLLM server see each other's load.
"""
from __future__ import annotations

import asyncio
import heapq
import itertools
import threading
import time
from collections import defaultdict
from typing import Any, Awaitable, Callable, Iterable

import httpx

from rolloutd.crds.node import ENGINE_CLIENT_KEEP_ALIVE_SECONDS

from .admission import Admission


class BackendPool:
    def __init__(self, admission: Admission | None = None) -> None:
        self.admission = admission if admission is not None else Admission(time.time)
        self.inflight: dict[str, int] = defaultdict(int)
        self.unhealthy: dict[str, str] = {}  # url → reason
        self._heap: list[tuple[int, int, str]] = []
        self._seq = itertools.count()
        self._known: set[str] = set()

    def add(self, url: str) -> None:
        if url not in self._known:
            self._known.add(url)
            self._push(url)

    def discard(self, url: str) -> None:
        """Forget a backend that no job lists any more (its in-flight count stays until released)."""
        self._known.discard(url)

    def known(self) -> set[str]:
        return set(self._known)

    def healthy(self, url: str) -> bool:
        return url in self._known and url not in self.unhealthy

    def outage(self, url: str | None, urls: list[str]) -> bool:
        """Backend `url` is down and so is every other of `urls` (a job's): a failure on it is the outage's, and
        its rollout waits in the queue (leasing pauses) until a backend is healthy again."""
        return bool(url) and not self.healthy(url) and not any(self.healthy(u) for u in urls)

    def set_health(self, url: str, ok: bool, reason: str = "") -> bool:
        """Returns True when the state changed."""
        was = url not in self.unhealthy
        if ok:
            self.unhealthy.pop(url, None)
            if not was:
                self._push(url)
        else:
            self.unhealthy[url] = reason or "unhealthy"
            self.admission.unlearn(url)  # it may come back with another max_num_seqs
        return was != ok

    def _push(self, url: str) -> None:
        heapq.heappush(self._heap, (self.inflight[url], next(self._seq), url))

    def acquire(self, allowed: Iterable[str], job: str | None = None) -> str | None:
        """Pin the least-loaded healthy backend among `allowed` that admits one more episode of `job`;
        None if there is none."""
        allowed = set(allowed)
        aside: list[tuple[int, int, str]] = []
        chosen = None
        while self._heap:
            entry = heapq.heappop(self._heap)
            count, _, url = entry
            if url not in self._known or url in self.unhealthy or count != self.inflight[url]:
                continue  # stale entry: a fresher one exists or the backend is out
            if url in allowed and self.admission.admits(url, job, count):
                chosen = url
                break
            aside.append(entry)
        for entry in aside:
            heapq.heappush(self._heap, entry)
        if chosen is None:
            # `allowed` may hold backends never added (e.g. just listed by a job): add and retry once
            fresh = [u for u in allowed if u not in self._known]
            for u in fresh:
                self.add(u)
            if fresh:
                return self.acquire(allowed, job)  # terminates: nothing is fresh the second time
            return None
        self.inflight[chosen] += 1
        self.admission.take(chosen, job)
        self._push(chosen)
        return chosen

    def take(self, url: str, job: str | None = None) -> None:
        """Count a pin restored from the database (controller restart)."""
        self.inflight[url] += 1
        self.admission.take(url, job)
        if url in self._known:
            self._push(url)

    def release(self, url: str | None, job: str | None = None) -> None:
        if not url:
            return
        if self.inflight[url] > 0:
            self.inflight[url] -= 1
        if url in self._known and url not in self.unhealthy:
            self._push(url)
        self.admission.give(url, job)

    def pinned(self, job: str) -> dict[str, int]:
        """Backend URL → the job's tasks pinned to it now, from admission's counts in memory, not a GROUP BY over the
        job's items (a dashboard asks every second; docs/content/benchmarks.md, "Constants")."""
        return {url: n for url, jobs in list(self.admission.admitted.items()) if (n := jobs.get(job, 0)) > 0}

    def view(self, job: str, urls: Iterable[str], shown: Callable[[str], bool] = lambda url: True) -> list[dict]:
        """The job's backends as the trainer API and the web UI show them; `shown(url)` False: a caller who may see
        only that the backend is up or down (its reason reads "down")."""
        pinned, out = self.pinned(job), []
        for url in urls:
            url = url.rstrip("/")
            reason = self.unhealthy.get(url, "")
            out.append({"url": url, "healthy": url not in self.unhealthy,
                        "reason": "down" if reason and not shown(url) else reason,
                        "inflight": self.inflight.get(url, 0), "pinnedToJob": pinned.get(url, 0),
                        "admissionCap": self.admission.cap(url, job)})
        return out


def failure(e: BaseException) -> str:
    """A fixed reason for a failed call to a backend: the error's kind, never its text (an exception's message
    can quote what the server sent, e.g. a malformed status line, and a backend URL may be any loopback service)."""
    if isinstance(e, httpx.TimeoutException):
        return "timed out"
    if isinstance(e, httpx.ConnectError):
        return "connection failed"
    if isinstance(e, httpx.HTTPError):
        return f"request failed ({type(e).__name__})"
    return "failed"


class BackendHttp:
    """The controller's one HTTP client to the backends (created on first use, shared by the calls below).

    What it reports of an answer is its status and a fixed reason, never the body."""

    def __init__(self) -> None:
        self._client: httpx.AsyncClient | None = None

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(limits=httpx.Limits(keepalive_expiry=ENGINE_CLIENT_KEEP_ALIVE_SECONDS))
        return self._client

    async def post(self, url: str, path: str, params: dict[str, Any] | None = None) -> str | None:
        """One admin call (`/pause`, `/resume`): None when it answered 200, else a fixed reason."""
        try:
            r = await self.client.post(f"{url}{path}", params=params, timeout=120)
        except Exception as e:  # noqa: BLE001 - reported per backend
            return f"{path}: {failure(e)}"
        return None if r.status_code == 200 else f"{path}: HTTP {r.status_code}"

    async def load(self, url: str, weights_path: str | None, *, running: bool,
                   label: str | None = None, reset: bool = True) -> dict[str, Any]:
        """On a paused engine: reload weights, then label them (`label`) and, meanwhile, reset the prefix cache —
        with `running`, also the KV of the requests kept in place (keep mode), which the engine recomputes on the new
        weights when it resumes. Not `reset`: the pause cleared it and the engine computed nothing since (abort
        mode: `/pause?mode=abort&clear_cache=true` aborts every request and queues new ones unscheduled)."""
        out: dict[str, Any] = {"url": url, "reloaded": False, "error": None}
        step = "reload_weights"
        try:
            if weights_path:
                t = time.monotonic()
                r = await self.client.post(f"{url}/collective_rpc", timeout=300, json={
                    "method": "reload_weights", "kwargs": {"weights_path": str(weights_path)}})
                if r.status_code != 200:
                    out["error"] = f"reload_weights: HTTP {r.status_code}"
                    return out
                out["reloaded"], out["reloadSeconds"] = True, round(time.monotonic() - t, 3)
            step, t = "reset_prefix_cache", time.monotonic()
            out["error"], out["resetTries"] = await asyncio.gather(self.label(url, label),
                                                                   self._reset(url, running) if reset else _none())
            out["resetSeconds"] = round(time.monotonic() - t, 3)
        except Exception as e:  # noqa: BLE001 - reported per backend; the others still update
            out["error"] = f"{step}: {failure(e)}"
        return out

    async def _reset(self, url: str, running: bool) -> int:
        """Reset the engine's prefix cache; the tries it took (the answer is false while blocks are still held by
        requests finishing: tried again every 20 ms, 50 times at most)."""
        params = {"reset_running_requests": "true"} if running else None
        for tries in range(1, 51):
            r = await self.client.post(f"{url}/reset_prefix_cache", params=params, timeout=30)
            if r.status_code != 200 or "false" not in r.text.lower():
                break
            await asyncio.sleep(0.02)
        return tries

    async def label(self, url: str, label: str | None) -> str | None:
        """Label a paused engine's weights (vLLM's `/update_weight_version`: it stamps every token it generates from
        now on with it), after they loaded, so a label never names weights the engine does not run. An engine
        without the call (404: it stamps nothing either) is no error; the call is tried three times, and a failure
        is the backend's error (its tokens keep the old label: the update is reported as not taken there)."""
        if label is None:
            return None
        why = None
        for _ in range(3):
            try:
                r = await self.client.post(f"{url}/update_weight_version", json={"new_version": label}, timeout=30)
            except Exception as e:  # noqa: BLE001 - reported per backend
                why = f"update_weight_version: {failure(e)}"
                continue
            if r.status_code in (200, 404):
                return None
            why = f"update_weight_version: HTTP {r.status_code}"
        return why

    async def update(self, url: str, weights_path: str | None, pause: bool,
                     label: str | None = None) -> dict[str, Any]:
        """vLLM's admin sequence for a new policy: pause (waiting for the requests in flight) → `load` → resume.
        Errors are reported in the answer as the step, a status and a fixed reason (the other backends still
        update)."""
        out: dict[str, Any] = {"url": url, "reloaded": False, "error": None}
        try:
            if pause:
                try:
                    await self.client.post(f"{url}/pause", params={"mode": "wait"}, timeout=120)
                except Exception as e:  # noqa: BLE001 - reported per backend
                    out["error"] = f"pause: {failure(e)}"
                    return out
            out = await self.load(url, weights_path, running=False, label=label)
        finally:
            if pause:
                try:
                    await self.client.post(f"{url}/resume", timeout=30)
                except httpx.HTTPError as e:
                    out["error"] = out["error"] or f"resume: {failure(e)}"
        return out

async def _none() -> int:
    return 0


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
