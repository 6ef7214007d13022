"""The controller's HTTP protocol closes a connection whose request head or body does not arrive whole in time
(`server._RequestDeadlines`): real uvicorn on a real socket, with the deadlines shortened for the test."""
from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
import uvicorn
from support.ports import free_port

from rolloutd.controller import server

BODY = b"x" * 100


async def _echo_length(scope, receive, send) -> None:
    """An app that reads the whole body, then answers its length; on /late it first waits 2.5 s (twice the
    deadline), as a route does that waits its turn of a namespace's request rate before it reads."""
    if scope["type"] != "http":
        return
    if scope["path"] == "/late":
        await asyncio.sleep(2.5)
    size, more = 0, True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        size, more = size + len(message.get("body", b"")), message.get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(str(size)))]})
    await send({"type": "http.response.body", "body": str(size).encode()})


@pytest.fixture
def port(monkeypatch):
    monkeypatch.setattr(server, "HEAD_SECONDS", 1.0)
    monkeypatch.setattr(server, "BODY_SECONDS", 1.0)
    port = free_port()
    srv = uvicorn.Server(server.server_config(_echo_length, "127.0.0.1", port, log_level="warning"))
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    while not srv.started:
        time.sleep(0.01)
    yield port
    srv.should_exit = True
    t.join(10)


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)  # 10× the deadline: a timeout is a held socket
    return sock


def _post_head(length: int = len(BODY)) -> bytes:
    return b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % length


def _answer(sock: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\r\n\r\n100"):
        chunk = sock.recv(4096)
        assert chunk, f"closed before the answer: {data!r}"
        data += chunk
    return data


def _closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(4096) == b""
    except ConnectionResetError:
        return True


def test_a_body_that_stops_short_of_its_length_is_closed(port):
    sock = _connect(port)
    sock.sendall(_post_head() + BODY[:10])
    assert _closed(sock)


def test_a_slow_body_that_arrives_in_time_is_answered_and_the_next_request_timed_afresh(port):
    sock = _connect(port)
    sock.sendall(_post_head() + BODY[:50])
    time.sleep(0.5)  # a slow client, within the body's deadline
    sock.sendall(BODY[50:])
    assert _answer(sock).startswith(b"HTTP/1.1 200")
    time.sleep(1.5)  # idle on a kept-alive connection past the head deadline: idle is keep-alive's to time, not ours
    sock.sendall(_post_head() + BODY)
    assert _answer(sock).startswith(b"HTTP/1.1 200")
    sock.sendall(_post_head()[:20])  # then half a head
    assert _closed(sock)


def test_a_connection_with_no_head_is_closed(port):
    assert _closed(_connect(port))


def test_a_body_the_app_is_slow_to_read_is_not_cut(port):
    """Past 64 KiB unread, uvicorn stops reading the socket until the app reads: that wait is the app's, not the
    client's, so it does not count against the body's deadline (the body was cut at the deadline: closed, no answer)."""
    big = 1 << 20
    sock = _connect(port)
    sender = threading.Thread(target=sock.sendall,
                              args=(b"POST /late HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % big + b"y" * big,))
    sender.start()
    data = b""
    while not data.endswith(str(big).encode()):
        chunk = sock.recv(4096)
        assert chunk, f"closed before the answer: {data!r}"
        data += chunk
    sender.join(10)
    assert data.startswith(b"HTTP/1.1 200"), data
