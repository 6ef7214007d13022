"""The connection budget's choice (unit, real sockets): at the budget the connection waiting longest for a head is
shut down for the newcomer, one serving a request never is, and with every one serving the newcomer is turned away;
the budget a descriptor limit leaves."""
from __future__ import annotations

import socket

from rolloutd.controller.http.connection_budget import ConnectionBudget, budget_for


def _pair() -> tuple[socket.socket, socket.socket]:
    return socket.socketpair()


def _shut(peer: socket.socket) -> bool:
    peer.settimeout(1)
    return peer.recv(1) == b""


def test_the_oldest_waiter_makes_room_and_a_request_being_served_is_never_displaced():
    budget = ConnectionBudget(2)
    (a, pa), (b, pb), (c, pc), (d, pd) = _pair(), _pair(), _pair(), _pair()
    assert budget.admit(a) and budget.admit(b)
    budget.serving(a.fileno())  # a has a request head in: b is the oldest waiter
    assert budget.admit(c) and _shut(pb) and len(budget) == 2
    budget.waiting(a.fileno())  # a answered and waits again: now the newest waiter, c the oldest
    assert budget.admit(d) and _shut(pc)
    budget.serving(a.fileno())
    budget.serving(d.fileno())
    e, pe = _pair()
    assert not budget.admit(e)  # both serve a request: the newcomer is not taken
    pa.settimeout(0.2)
    try:
        pa.recv(1)
        raise AssertionError("a connection serving a request was shut down")
    except TimeoutError:
        pass
    for s in (a, b, c, d, e, pa, pb, pc, pd, pe):
        s.close()


def test_a_connection_closed_meanwhile_frees_its_place_without_displacing_anyone():
    budget = ConnectionBudget(1)
    (a, pa), (b, pb) = _pair(), _pair()
    assert budget.admit(a)
    a.close()  # closed by its transport with no protocol told (a TLS handshake that failed)
    assert budget.admit(b) and len(budget) == 1 and budget.closed == 0
    for s in (b, pa, pb):
        s.close()


def test_the_budget_keeps_a_quarter_of_the_descriptors_and_at_least_256():
    assert budget_for(20000) == 15000
    assert budget_for(1024) == 768
    assert budget_for(512) == 256
    assert budget_for(20000, 1000) == 1000 and budget_for(512, 4000) == 256
