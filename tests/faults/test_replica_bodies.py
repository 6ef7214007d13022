"""A replica reads a call's body before the app checks anything (it forwards a follower's leader-only calls and a
node's calls whole): that read is bounded by the largest body any route takes, so no client, with or without a
token, makes a replica hold more; and a body its client left inside is not passed on as if whole. Real controller
replicas (two processes on one SQLite store), raw sockets for the bodies no HTTP client library sends."""
from __future__ import annotations

import socket
from pathlib import Path

import pytest

from rolloutd.controller.http.node_protocol import RESULTS_MAX_BYTES
from support.replicas import Replicas

NODE_CALL = "/apis/rolloutd.io/v1alpha1/nodes/n-x/heartbeat"  # a follower forwards it to the leader
CHUNK = b"x" * (1 << 20)


@pytest.fixture(scope="module")
def follower(tmp_path_factory):
    replicas = Replicas(tmp_path_factory.mktemp("bodies"), {})
    try:
        replicas.start(0)
        replicas.wait_leader(120)
        yield replicas.start(1)
    finally:
        replicas.stop()


def _peak_kib(pid: int) -> int:
    """The process's peak resident memory (VmHWM), KiB."""
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("VmHWM:"))
    return int(line.split()[1])


def _answer(sock: socket.socket) -> tuple[int, bytes]:
    data = b""
    while b"\r\n\r\n" not in data or len(data) < data.index(b"\r\n\r\n") + 4 + 20:
        got = sock.recv(65536)
        if not got:
            break
        data += got
    return (int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/") else 0), data  # 0: closed without an answer


def _send(port: int, head: bytes, body_chunks: int, chunked: bool) -> tuple[int, bytes]:
    """`head`, then up to `body_chunks` MiB of body (as chunked transfer encoding if `chunked`) until the server
    answers or closes; its status and answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(head)
        try:
            for _ in range(body_chunks):
                sock.sendall(b"%x\r\n%s\r\n" % (len(CHUNK), CHUNK) if chunked else CHUNK)
        except (BrokenPipeError, ConnectionResetError):
            pass  # it answered and closed: the answer is in the socket's buffer
        return _answer(sock)


def test_a_declared_body_past_the_limit_is_refused_before_a_byte_of_it_is_read(follower):
    size = 4 * RESULTS_MAX_BYTES
    head = (f"POST {NODE_CALL} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {size}\r\n\r\n").encode()
    status, answer = _send(follower.port, head, 0, chunked=False)
    assert status == 413 and str(RESULTS_MAX_BYTES).encode() in answer, answer[:400]


def test_a_streamed_body_past_the_limit_is_cut_there_not_held_whole(follower):
    """No declared length (chunked): the replica stops at the limit, 413, and its peak memory grows by less than
    the body (before: the whole body held, and copied once per chunk received, then sent on to the leader)."""
    before = _peak_kib(follower.proc.pid)
    mib = RESULTS_MAX_BYTES // len(CHUNK) * 5 // 2
    head = (f"POST {NODE_CALL} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            "Transfer-Encoding: chunked\r\n\r\n").encode()
    status, answer = _send(follower.port, head, mib, chunked=True)
    assert status == 413 and str(RESULTS_MAX_BYTES).encode() in answer, answer[:400]
    grown_mib = (_peak_kib(follower.proc.pid) - before) / 1024
    assert grown_mib < mib * 0.6, f"the replica's peak memory grew {grown_mib:.0f} MiB for a {mib} MiB body"


def test_a_body_under_the_limit_is_still_forwarded_whole(follower):
    """The leader answers it (no token: 401), not the replica."""
    body = b'{"stages": {}}'
    head = (f"POST {NODE_CALL} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    status, answer = _send(follower.port, head, 0, chunked=False)
    assert status == 401, answer[:400]
