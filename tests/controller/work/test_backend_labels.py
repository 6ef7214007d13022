"""The controller's weight labels (feature weight-stamps): `BackendHttp.load` labels a paused engine's weights only once
they loaded, so a label never names weights the engine does not run; an engine without labels is no error. The engine
side (its stamps, by replay) is tests/e2e/test_async_updates.py."""
from __future__ import annotations

import asyncio
import json

import httpx

from rolloutd.controller.work.backend_http import BackendHttp


def backend(answers: dict[str, int]) -> tuple[BackendHttp, list[tuple[str, object]]]:
    """A BackendHttp whose engine answers each path with `answers[path]` (200 by default), recording the calls."""
    calls: list[tuple[str, object]] = []

    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        calls.append((request.url.path, body))
        return httpx.Response(answers.get(request.url.path, 200), json={"success": True})
    http = BackendHttp()
    http._client = httpx.AsyncClient(transport=httpx.MockTransport(handle))
    return http, calls


def test_the_label_follows_a_reload_that_worked():
    http, calls = backend({})
    out = asyncio.run(http.load("http://e", "/ckpt", running=True, label="L1"))
    assert out["error"] is None and out["reloaded"]
    paths = [p for p, _ in calls]
    assert paths[0] == "/collective_rpc" and set(paths[1:]) == {"/update_weight_version", "/reset_prefix_cache"}
    assert ("/update_weight_version", {"new_version": "L1"}) in calls


def test_a_load_after_a_pause_that_cleared_the_cache_resets_nothing_again():
    http, calls = backend({})
    out = asyncio.run(http.load("http://e", "/ckpt", running=False, label="L1", reset=False))
    assert out["error"] is None and out["reloaded"] and out["resetTries"] == 0
    assert [p for p, _ in calls] == ["/collective_rpc", "/update_weight_version"]


def test_a_reload_that_failed_keeps_the_old_label():
    http, calls = backend({"/collective_rpc": 500})
    out = asyncio.run(http.load("http://e", "/ckpt", running=False, label="L1"))
    assert out["error"] == "reload_weights: HTTP 500" and not out["reloaded"]
    assert [p for p, _ in calls] == ["/collective_rpc"]


def test_an_engine_without_labels_is_no_error_and_a_refused_label_is_the_backends_error():
    http, _ = backend({"/update_weight_version": 404})
    assert asyncio.run(http.load("http://e", None, running=False, label="L1"))["error"] is None
    http, calls = backend({"/update_weight_version": 500})
    out = asyncio.run(http.update("http://e", "/ckpt", pause=True, label="L1"))
    assert out["error"] == "update_weight_version: HTTP 500"
    assert [p for p, _ in calls].count("/update_weight_version") == 3 and calls[-1][0] == "/resume"
