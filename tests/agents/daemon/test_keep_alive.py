"""A daemon keeps its one connection to the controller open across its beats: a paced beat comes every 2–6 s at
a thousand nodes, past the 4 s the LLM pool keeps a connection and uvicorn's default 5 s; the daemon closes an
idle connection before the controller does (a request sent as the server closes it would fail)."""
from __future__ import annotations

import asyncio

from rolloutd.agents.daemon.controller_client import ControllerClient
from rolloutd.crds.node import (
    CONTROLLER_KEEP_ALIVE_SECONDS,
    DAEMON_KEEP_ALIVE_SECONDS,
    beat_gap,
    heartbeat_seconds,
    spaced_gap,
)


def test_the_daemon_outlasts_every_beat_gap_and_closes_before_the_controller():
    longest_paced = spaced_gap(beat_gap(1000), 1.0)
    longest_timed = heartbeat_seconds(1000, 600)  # the interval at a thousand nodes, a long lease
    assert max(longest_paced, longest_timed) < DAEMON_KEEP_ALIVE_SECONDS < CONTROLLER_KEEP_ALIVE_SECONDS


def test_the_daemons_client_keeps_idle_connections_that_long():
    async def pools():
        client = ControllerClient("http://127.0.0.1:1", "t")
        try:
            http = client._http
            mounted = [t for pattern, t in http._mounts.items() if pattern.pattern == "http://"]
            return [t.keepalive_expiry for t in mounted], http._transport._pool._keepalive_expiry
        finally:
            await client.aclose()

    plain, httpx_pool = asyncio.run(pools())
    assert plain in ([DAEMON_KEEP_ALIVE_SECONDS], [])  # the keep-alive pool (absent behind a proxy)
    assert httpx_pool == DAEMON_KEEP_ALIVE_SECONDS    # https and proxied connections


def test_the_controller_keeps_an_idle_node_connection_longer():
    from rolloutd.controller.server import server_config

    assert server_config(object(), "127.0.0.1", 0).timeout_keep_alive == int(CONTROLLER_KEEP_ALIVE_SECONDS)
