"""The controller's connections, bounded below its file-descriptor limit: past the budget, the connection that has
waited longest for a request head (new, mid-TLS-handshake, or kept alive between requests) is closed for the new one.

`ListeningSocket.accept` counts each connection as the event loop accepts it, plain or TLS alike (before any
handshake); `server._RequestDeadlines` says when one is serving a request and when it waits again. Why: each
connection holds a descriptor, and the head deadlines alone let a client that opens a few thousand connections a
second take every descriptor the process has: accepting stops, and so does every descriptor the controller itself
needs (its store, its subprocesses). A connection serving a request (a trainer's stream, a node's call) is never the
one closed: a flood only ever displaces its own kind, and a client that sends its head at once is served.
"""
from __future__ import annotations

import collections
import logging
import resource
import socket
import time

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

log = logging.getLogger("rolloutd.server")

RESERVE = 256  # descriptors kept for the controller's own use (store, logs, subprocesses, outgoing calls) at least,
RESERVE_PART = 4  # or this part of the limit, whichever is more
LOG_SECONDS = 10.0


def raise_descriptor_limit() -> int:
    """The soft RLIMIT_NOFILE raised to the hard one (what a server may take without privilege); the limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    return soft


def budget_for(limit: int, setting: int | None = None) -> int:
    """The connections a process with `limit` descriptors serves at once: the limit less its reserve, or the
    operator's `setting` if smaller."""
    derived = max(16, limit - max(RESERVE, limit // RESERVE_PART))
    return min(derived, setting) if setting else derived


class ConnectionBudget:
    """Accepted connections by descriptor: those waiting for a head, oldest first, and those serving a request."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._waiting: collections.OrderedDict[int, socket.socket] = collections.OrderedDict()
        self._serving: dict[int, socket.socket] = {}
        self.closed = 0  # connections closed or turned away for newer ones since the start
        self._told = (0.0, 0)  # when the log last said so, and the count then

    def __len__(self) -> int:
        return len(self._waiting) + len(self._serving)

    def admit(self, conn: socket.socket) -> bool:
        """Count `conn` (just accepted); at the budget, close the connection waiting longest for a head to make
        room. False: every counted connection is serving a request, so `conn` is not taken (the caller closes it)."""
        fd = conn.fileno()
        self._waiting.pop(fd, None)  # a connection closed unseen held this descriptor before
        self._serving.pop(fd, None)
        if len(self) >= self.limit and not self._make_room():
            self.closed += 1
            self._tell()
            return False
        self._waiting[fd] = conn
        return True

    def serving(self, fd: int) -> None:
        """The connection on `fd` has a request head in: it is not to be displaced until it waits again."""
        conn = self._waiting.pop(fd, None)
        if conn is not None:
            self._serving[fd] = conn

    def waiting(self, fd: int) -> None:
        """The connection on `fd` answered its request and waits for the next head: from now on, the newest waiter."""
        conn = self._serving.pop(fd, None) or self._waiting.pop(fd, None)
        if conn is not None:
            self._waiting[fd] = conn

    def gone(self, fd: int) -> None:
        self._waiting.pop(fd, None)
        self._serving.pop(fd, None)

    def _make_room(self) -> bool:
        """Shut the oldest waiter down (its transport sees the end and closes it), or forget one closed meanwhile (a
        TLS handshake that failed, a websocket: no protocol of ours is told); False when none of either is left."""
        if self._waiting:
            fd, conn = self._waiting.popitem(last=False)
            if conn.fileno() != fd:  # closed meanwhile: its place is free already
                return True
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self.closed += 1
            self._tell()
            return True
        closed = next((fd for fd, conn in self._serving.items() if conn.fileno() != fd), None)
        if closed is not None:
            del self._serving[closed]
            return True
        return False

    def _tell(self) -> None:
        """A warning at most every LOG_SECONDS while connections are being closed: a flood, or a budget too small."""
        now = time.monotonic()
        if now - self._told[0] >= LOG_SECONDS:
            log.warning("%d connection(s) closed or turned away since the last warning: the budget of %d "
                        "connections is full (ROLLOUTD_MAX_CONNECTIONS, the descriptor limit)",
                        self.closed - self._told[1], self.limit)
            self._told = (now, self.closed)


class ListeningSocket(socket.socket):
    """The controller's listening socket: each accepted connection is counted against `budget`."""

    budget: ConnectionBudget

    def accept(self):  # type: ignore[override]
        while True:
            conn, addr = super().accept()
            if self.budget.admit(conn):
                return conn, addr
            conn.close()  # every counted connection serves a request: the newcomer is turned away


def listening_socket(host: str, port: int, budget: ConnectionBudget) -> ListeningSocket:
    """A bound TCP socket for `host`:`port` (IPv6 when the host is an IPv6 address), as uvicorn binds its own."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = ListeningSocket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.budget = budget
    return sock


class Collector:
    """/metrics: the connections held, the budget, and those closed or turned away for newer ones."""

    def __init__(self, budget: ConnectionBudget) -> None:
        self.budget = budget

    def collect(self):
        held = GaugeMetricFamily("rolloutd_connections", "client connections the controller holds")
        held.add_metric([], len(self.budget))
        limit = GaugeMetricFamily("rolloutd_connections_budget", "client connections it holds at most "
                                  "(ROLLOUTD_MAX_CONNECTIONS, the descriptor limit)")
        limit.add_metric([], self.budget.limit)
        closed = CounterMetricFamily("rolloutd_connections_closed", "connections closed or turned away at the "
                                     "budget: the one waiting longest for a request head, or a newcomer")
        closed.add_metric([], self.budget.closed)
        yield from (held, limit, closed)
