"""Unix sockets at host paths of any length: a sandbox's control directory (`<ROLLOUTD_SANDBOX_DIR>/<id>/ctl/`) holds
the exec server's, the harness gateway's and the egress proxy's sockets, and under a deep sandbox directory (a CI
clone's, pytest's per-worker temporary directories) their paths outgrow `sun_path` (107 bytes and a NUL: "AF_UNIX
path too long"). A longer path is bound and connected through `/proc/self/fd/<fd of its directory>/<name>`.

Used by `ExecClient.connect` (sandbox/client.py), `EgressProxy.start` (host/egress.py) and the gateway's `start`
(agents/gateway/server.py); the exec server binds inside the sandbox, at a short path of its own.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Iterator
from pathlib import Path

SUN_PATH_MAX = 107  # bytes of a socket's path: sockaddr_un's sun_path is 108, with the NUL


@contextlib.contextmanager
def reachable(path: str | Path) -> Iterator[str]:
    """`path` itself if `sun_path` holds it, else the same place reached through a descriptor of its directory,
    held open for the block (bind and connect resolve it once, at the call)."""
    path = os.fspath(path)
    if len(os.fsencode(path)) <= SUN_PATH_MAX:
        yield path
        return
    parent, name = os.path.split(path)
    fd = os.open(parent or ".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{fd}/{name}"
    finally:
        os.close(fd)


def listening(path: str | Path, mode: int | None = None) -> socket.socket:
    """A non-blocking stream socket bound at `path` (made `mode` if given) and listening: for asyncio's
    `start_unix_server(sock=…)` and uvicorn's `serve(sockets=[…])`."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with reachable(path) as at:
            sock.bind(at)
        if mode is not None:
            os.chmod(path, mode)
        sock.listen(socket.SOMAXCONN)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


async def connected(path: str | Path) -> socket.socket:
    """A non-blocking stream socket connected to the server at `path`: for `create_unix_connection(sock=…)`."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        with reachable(path) as at:
            await asyncio.get_running_loop().sock_connect(sock, at)
    except BaseException:
        sock.close()
        raise
    return sock
