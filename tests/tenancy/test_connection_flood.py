"""A client that opens connections faster than the head deadline closes them cannot take the controller's file
descriptors: past its connection budget the controller closes the connection that has waited longest for a head, so
/healthz, the API and a watch already open are served through the flood (the real controller, plain and over TLS,
its descriptor limit lowered to 2048 so that the flood is small; no token sent by the flood)."""
from __future__ import annotations

import re
import select
import socket
import ssl
import threading
import time

import httpx
import pytest

from support.controller_process import ControllerProcess
from support.kube_controller import self_signed
from support.tenancy_helpers import job, jobs_path

NOFILE = 2048  # the controller's budget: 2048 less a quarter = 1536 connections
FLOOD = 2600  # connections the flood keeps open: more than the controller's descriptors
RATE = 300.0  # new ones a second: the head deadline (10 s) would leave 3000 open; the budget keeps each ~5 s


class Flood:
    """Keeps up to FLOOD connections open to `port`, none sending a byte; each one the server closes is opened
    again (`rate` new ones a second), as a client that wants to hold every descriptor would."""

    def __init__(self, port: int, rate: float = RATE) -> None:
        self.port, self.rate = port, rate
        self.socks: dict[int, socket.socket] = {}
        self.poll = select.poll()
        self.opened = 0
        self.closed_by_server = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "Flood":
        self.thread.start()
        deadline = time.monotonic() + 60
        while self.opened < FLOOD and time.monotonic() < deadline:  # more than the controller's descriptors
            time.sleep(0.05)
        assert self.opened >= FLOOD, f"the flood opened {self.opened} connections"
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(10)
        for s in self.socks.values():
            s.close()

    def _run(self) -> None:
        while not self.stop.is_set():
            t = time.monotonic()
            for fd, _ in self.poll.poll(0):  # a socket the server closed reads its end (or a reset)
                s = self.socks[fd]
                try:
                    gone = s.recv(1) == b""
                except OSError:
                    gone = True
                if gone:
                    self.closed_by_server += 1
                    self.poll.unregister(fd)
                    del self.socks[fd]
                    s.close()
            for _ in range(min(FLOOD - len(self.socks), int(self.rate * 0.05) + 1)):
                s = socket.socket()
                s.settimeout(5)
                try:
                    s.connect(("127.0.0.1", self.port))
                except OSError:
                    s.close()
                    break
                self.socks[s.fileno()] = s
                self.poll.register(s, select.POLLIN)
                self.opened += 1
            self.stop.wait(max(0.0, 0.05 - (time.monotonic() - t)))


@pytest.fixture(params=["http", "https"])
def flooded(request, tmp_path):
    if request.param == "https":
        cert, key = self_signed(tmp_path)
        c = ControllerProcess(tmp_path / "data", extra_args=("--tls-cert-file", str(cert), "--tls-key-file", str(key)),
                              scheme="https", verify=ssl.create_default_context(cafile=str(cert)), nofile=NOFILE)
    else:
        c = ControllerProcess(tmp_path / "data", nofile=NOFILE)
    c.start()
    try:
        yield c
    finally:
        c.stop()


def _answered(c: ControllerProcess, what: str, call) -> None:
    """`call()` answered with a 2xx, allowing one resend: a connection the flood displaced before the request's
    head arrived (1536 of the flood's connections opened meanwhile: ~5 s at RATE) is closed, not refused."""
    for attempt in (1, 2):
        try:
            r = call()
            assert r.status_code < 300, f"{what}: {r.status_code} {r.text[:200]}"
            return
        except httpx.TransportError as e:
            if attempt == 2:
                raise AssertionError(f"{what} not answered during the flood: {e!r}") from e


def test_a_connection_flood_does_not_take_the_controllers_descriptors(flooded):
    c = flooded
    watched: list[bytes] = []
    with c.client() as api, httpx.Client(base_url=c.url, verify=c.verify, timeout=httpx.Timeout(10, read=120),
                                         headers={"Authorization": f"Bearer {c.token}"}) as streams:
        with streams.stream("GET", jobs_path("default"), params={"watch": "true", "timeoutSeconds": 110}) as watch:
            assert watch.status_code == 200
            def read() -> None:
                try:
                    watched.extend(line for line in watch.iter_lines() if "flooded" in line)
                except httpx.HTTPError:
                    pass  # closed when the test ends

            threading.Thread(target=read, daemon=True).start()
            with Flood(c.port) as flood:
                for i in range(10):
                    _answered(c, "/healthz", lambda: httpx.get(f"{c.url}/healthz", verify=c.verify, timeout=10))
                    _answered(c, "a list", lambda: api.get(jobs_path("default"), timeout=10))
                _answered(c, "a create", lambda: api.post(jobs_path("default"), json=job("flooded"), timeout=10))
                deadline = time.monotonic() + 30
                while not watched and time.monotonic() < deadline:
                    time.sleep(0.1)
                # the watch opened before the flood was serving all along: never the one closed
                assert watched, "the watch opened before the flood saw no event of the job created during it"
                assert flood.closed_by_server >= FLOOD - 1536, flood.closed_by_server  # displaced, not timed out
            metrics = api.get("/metrics").text
            assert re.search(r"^rolloutd_connections_budget 1536\.0$", metrics, re.M), metrics
            closed = float(re.search(r"^rolloutd_connections_closed_total (\S+)$", metrics, re.M)[1])
            assert closed >= flood.closed_by_server, (closed, flood.closed_by_server)
