"""Tenancy, the egress proxy of image builds and of the verifier (sandbox/host/egress.py): the real proxy on a Unix
socket, asked as a build step asks it, refuses loopback, private, link-local and metadata destinations (by
address, by name, by a name that resolves to loopback, in IPv4-mapped and other embedded forms) and never
connects to them; a public address passes the filter. No traffic leaves this machine: refused destinations
are never connected to, and public ones are only checked, not reached."""
from __future__ import annotations

import asyncio
import http.server
import ipaddress
import json
import shutil
import subprocess
import socket
import threading
import time

import pytest

from rolloutd.sandbox.host.egress import pick_address, refusal, serving
from rolloutd.crds.kit.settings import SandboxSettings


def _secret_server(host: str) -> tuple[http.server.ThreadingHTTPServer, list[str]]:
    """An HTTP server on `host` answering "secret" to every GET, and the paths it was asked for (a proxy that lets a
    request through shows up there)."""
    hits = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            hits.append(self.path)
            self.send_response(200)
            self.send_header("Content-Length", "6")
            self.end_headers()
            self.wfile.write(b"secret")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer((host, 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, hits


@pytest.fixture(scope="module")
def loopback_server():
    server, hits = _secret_server("127.0.0.1")
    yield server.server_port, hits
    server.shutdown()
    server.server_close()


@pytest.fixture()
def proxy(tmp_path):
    with serving(tmp_path / "egress.sock") as served:  # no network allowed
        yield tmp_path / "egress.sock", served


def _ask(path, request: str) -> str:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(20)
        s.connect(str(path))
        if request:
            s.sendall(request.encode())
        else:
            s.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
        return data.decode("latin-1")


def _loopback_names() -> list[str]:
    """Host names that resolve to loopback here: this machine's name (/etc/hosts) where it does, and the
    numeric forms getaddrinfo reads as 127.0.0.1."""
    names = ["2130706433", "0x7f.1", "127.1"]
    try:
        if all(ipaddress.ip_address(i[4][0]).is_loopback for i in socket.getaddrinfo(socket.gethostname(), 80)):
            names.append(socket.gethostname())
    except OSError:
        pass
    return names


def test_the_proxy_refuses_internal_destinations_and_never_connects(proxy, loopback_server):
    path, served = proxy
    port, hits = loopback_server
    targets = [f"127.0.0.1:{port}", f"[::1]:{port}", f"localhost:{port}", f"[::ffff:127.0.0.1]:{port}",
               *(f"{name}:{port}" for name in _loopback_names()),
               "10.0.0.1:80", "172.16.0.1:443", "192.168.1.1:443", "169.254.169.254:80", "[fd00:ec2::254]:80",
               "[fe80::1]:80", "0.0.0.0:80", "224.0.0.1:80", "100.100.100.200:80", "metadata.google.internal:80",
               "[64:ff9b::a9fe:a9fe]:80", "[2002:7f00:1::]:80"]
    for target in targets:
        answer = _ask(path, f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n")
        assert answer.startswith("HTTP/1.1 403"), (target, answer)
    for url in (f"http://127.0.0.1:{port}/token", f"http://localhost:{port}/token",
                "http://169.254.169.254/latest/meta-data/"):
        answer = _ask(path, f"GET {url} HTTP/1.1\r\nHost: x\r\n\r\n")
        assert answer.startswith("HTTP/1.1 403") and "secret" not in answer, (url, answer)
    assert hits == []
    assert len(served.refused) == len(targets) + 3


def test_the_admin_may_allow_a_network(tmp_path, loopback_server):
    """ROLLOUTD_EGRESS_ALLOW (e.g. a site mirror): the named network passes, nothing else does."""
    port, hits = loopback_server
    allow = SandboxSettings.from_env({"ROLLOUTD_EGRESS_ALLOW": "127.0.0.1/32"}).egress_allow
    with serving(tmp_path / "egress.sock", allow):
        assert "secret" in _ask(tmp_path / "egress.sock", f"GET http://127.0.0.1:{port}/ok HTTP/1.1\r\n"
                                                          "Host: x\r\nConnection: close\r\n\r\n")
        assert _ask(tmp_path / "egress.sock", "CONNECT 10.0.0.1:80 HTTP/1.1\r\n\r\n").startswith("HTTP/1.1 403")
    assert len(hits) == 1 and hits[0].endswith("/ok")


def test_a_step_cannot_spend_the_daemons_descriptors(proxy):
    """Connections beyond MAX_CONNECTIONS at once are answered 503 and closed at once."""
    from rolloutd.sandbox.host.egress import MAX_CONNECTIONS

    path, _ = proxy
    held = []
    try:
        for _ in range(MAX_CONNECTIONS):
            s = socket.socket(socket.AF_UNIX)
            s.connect(str(path))
            held.append(s)
        assert _ask(path, "").startswith("HTTP/1.1 503")  # answered before it asks anything
        held.pop().close()
        until = time.monotonic() + 10  # a slot comes free once the server has seen that close
        while (answer := _ask(path, "")).startswith("HTTP/1.1 503"):
            assert time.monotonic() < until
        assert answer == ""  # served: waiting for its request (closed by us, unanswered)
    finally:
        for s in held:
            s.close()


@pytest.mark.parametrize("address", ["127.0.0.1", "127.8.9.10", "10.1.2.3", "172.31.255.1", "192.168.0.1",
                                     "169.254.169.254", "100.100.100.200", "0.0.0.0", "224.0.0.251",
                                     "255.255.255.255", "::1", "::", "fd00:ec2::254", "fe80::1%2", "ff02::1",
                                     "::ffff:127.0.0.1", "::ffff:169.254.169.254", "::127.0.0.1",
                                     "2002:a00:1::", "64:ff9b::7f00:1", "2001:0:4136:e378:8000:63bf:80ff:fffe"])
def test_an_internal_address_is_refused(address):
    assert refusal(address) is not None


@pytest.mark.parametrize("address", ["151.101.2.132", "104.16.0.1", "2a04:4e42::644", "2606:4700::1111"])
def test_a_public_address_passes_the_filter(address):
    assert refusal(address) is None
    assert asyncio.run(pick_address(address, 443)) == (address, None)  # checked only: nothing is sent


def test_one_internal_address_among_a_names_answers_refuses_the_name(monkeypatch):
    """A name answering a public and a loopback address (a rebinding set-up) is refused as a whole, and the
    proxy connects to the address it checked, never looking the name up again."""
    async def fake_getaddrinfo(host, port, **kw):
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("151.101.2.132", port)),
                (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port))]

    async def main():
        monkeypatch.setattr(asyncio.get_running_loop(), "getaddrinfo", fake_getaddrinfo)
        return await pick_address("mirror.example.org", 443)

    address, why = asyncio.run(main())
    assert address is None and "loopback" in why


def _interface_addresses() -> list[str]:
    """This machine's own interface addresses (`ip -j addr`), loopback and link-local left out."""
    out = subprocess.run(["ip", "-j", "addr"], capture_output=True, text=True, check=True).stdout
    found = [a["local"] for i in json.loads(out) for a in i.get("addr_info", [])]
    return [a for a in found if not ipaddress.ip_address(a).is_loopback and not ipaddress.ip_address(a).is_link_local]


def test_the_proxy_refuses_the_nodes_own_interface_addresses(proxy):
    """Whatever its range (here a documentation or public one the range filter lets through), an address of the
    node's own interfaces reaches the node itself: a server listening there is never reached through the proxy."""
    if shutil.which("ip") is None:
        pytest.skip("needs iproute2's ip")
    addresses = _interface_addresses()
    ipv4 = [a for a in addresses if ipaddress.ip_address(a).version == 4]
    if not ipv4:
        pytest.skip("this machine has no IPv4 interface address besides loopback")
    server, hits = _secret_server(ipv4[0])  # on the interface only: nothing leaves
    try:
        path, served = proxy
        port = server.server_port
        answer = _ask(path, f"GET http://{ipv4[0]}:{port}/token HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert answer.startswith("HTTP/1.1 403") and "own interfaces" in answer and "secret" not in answer, answer
        for address in addresses:
            host = f"[{address}]" if ":" in address else address
            answer = _ask(path, f"CONNECT {host}:{port} HTTP/1.1\r\n\r\n")
            assert answer.startswith("HTTP/1.1 403"), (address, answer)
        assert hits == []
    finally:
        server.shutdown()
        server.server_close()
