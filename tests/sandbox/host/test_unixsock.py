"""Sockets under a sandbox directory deeper than `sun_path` holds (107 bytes): a real bwrap sandbox starts and answers
through its ctl/exec.sock, and the egress proxy serves its socket there (sandbox/host/unixsock.py). Before, both
failed with "AF_UNIX path too long" (pytest-xdist's per-worker temporary directories crossed the limit)."""
from __future__ import annotations

import asyncio
import os
import stat

from rolloutd.crds.kit.settings import SandboxSettings
from rolloutd.sandbox import SandboxSpec, create_sandbox
from rolloutd.sandbox.host.egress import EgressProxy
from rolloutd.sandbox.host.unixsock import SUN_PATH_MAX, connected, listening

from support.sandbox_checks import require_bwrap


def deep(tmp_path):
    """A directory whose own path already outgrows a socket's."""
    path = tmp_path / ("d" * 60) / ("e" * 60)
    path.mkdir(parents=True)
    assert len(os.fsencode(path / "x.sock")) > SUN_PATH_MAX
    return path


def test_a_sandbox_under_a_deep_sandbox_directory_starts_and_answers(run, tmp_path):
    require_bwrap()
    base = deep(tmp_path) / "sandboxes"

    async def main():
        sb = await create_sandbox(SandboxSpec(), SandboxSettings(sandbox_dir=base))
        try:
            assert len(os.fsencode(sb.root / "ctl" / "exec.sock")) > SUN_PATH_MAX
            return (await sb.bash("echo ok")).output
        finally:
            await sb.close()

    assert run(main()) == "ok\n"
    assert list(base.iterdir()) == []


def test_a_long_socket_path_is_bound_at_that_path_and_reached_by_it(tmp_path):
    path = deep(tmp_path) / "s.sock"

    async def main():
        async def echo(reader, writer):
            writer.write(await reader.readline())
            await writer.drain()
            writer.close()

        server = await asyncio.start_unix_server(echo, sock=listening(path, 0o666))
        try:
            assert stat.S_ISSOCK(os.stat(path).st_mode) and stat.S_IMODE(os.stat(path).st_mode) == 0o666
            reader, writer = await asyncio.open_unix_connection(sock=await connected(path))
            writer.write(b"hello\n")
            line = await reader.readline()
            writer.close()
            return line
        finally:
            server.close()
            await server.wait_closed()

    assert asyncio.run(main()) == b"hello\n"


def test_the_egress_proxy_serves_a_socket_in_a_deep_control_directory(tmp_path):
    path = deep(tmp_path) / "egress.sock"

    async def main():
        proxy = EgressProxy()
        await proxy.start(path)
        try:
            reader, writer = await asyncio.open_unix_connection(sock=await connected(path))
            writer.write(b"CONNECT 10.0.0.1:80 HTTP/1.1\r\nHost: 10.0.0.1:80\r\n\r\n")  # private: refused
            status = await reader.readline()
            writer.close()
            return status, stat.S_IMODE(os.stat(path).st_mode)
        finally:
            await proxy.stop()

    status, mode = asyncio.run(main())
    assert status.startswith(b"HTTP/1.1 403") and mode == 0o666, status
