"""vLLM's admin calls from the controller: pause, reload weights, label them, reset the prefix cache, resume.

Called by `policy_versions.PolicyVersions` (an announce: `update`, or `post` + `load` in keep and abort modes);
`backend_health.HealthProbe` shares the client for its probes. What goes back to the caller is a per-backend
report with a status and a fixed reason (`failure`), never an answer's body.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx

from rolloutd.crds.node import ENGINE_CLIENT_KEEP_ALIVE_SECONDS


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
