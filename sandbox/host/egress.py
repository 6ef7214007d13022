"""The one way out of a sandbox's network namespace: an HTTP proxy on a Unix socket that refuses internal addresses.

Where it sits: image builds (`build_step.run_in_rootfs`: every RUN of a Dockerfile, for apt/pip/npm) and the
Harbor verifier's EVAL (agents/tasks/harbor.py, through agents/gateway/egress.py) serve an `EgressProxy` on a socket
bound into the sandbox; a relay on the sandbox's own loopback (`relay.RELAY`, as the gateway's for the
verifier) turns it into `http_proxy`/`https_proxy`. Next step: downloaders inside reach public hosts only.

It speaks what downloaders use: `CONNECT host:port` (https, tunnelled as is) and plain-http requests in
absolute form (`GET http://host:port/path`), forwarded unchanged. Before connecting it resolves the host itself
and checks every address (`refusal`): loopback, private (RFC 1918, ULA), link-local (169.254.169.254, the
cloud metadata service, included), shared (CGNAT), reserved, unspecified, multicast, every address of the
node's own interfaces (`own_networks`, whatever its range, public ones too), and the
IPv4 inside IPv4-mapped, 6to4, Teredo and NAT64 forms are refused with 403, as are metadata and localhost names;
then it connects to the address it checked (no second lookup, so no DNS-rebinding gap). An admin may allow
chosen networks (a site mirror) with ROLLOUTD_EGRESS_ALLOW="10.1.2.3/32,...". Documentation ranges (TEST-NET)
are not refused: some sites resolve public registries into them.
"""
from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from urllib.parse import urlsplit

from .unixsock import listening

HEAD_LIMIT = 64 * 1024
MAX_CONNECTIONS = 64  # at once, per proxy: a step cannot spend the daemon's descriptors
MAX_REFUSED_KEPT = 100
HEAD_SECONDS = 30  # for the request line and headers
BLOCKED_NAMES = {"localhost", "metadata", "metadata.google.internal", "metadata.goog", "instance-data",
                 "instance-data.ec2.internal", "metadata.azure.internal"}
# What reaches the host itself, the site's private networks or a cloud's metadata service. (Documentation and
# benchmarking ranges are not here: nothing internal lives there by any standard; some sites' registry mirrors
# do.) The IPv4 inside IPv4-mapped, IPv4-compatible, 6to4, Teredo and NAT64 addresses is checked as IPv4.
REFUSED = [(ipaddress.ip_network(net), what) for nets, what in (
    (("127.0.0.0/8", "::1/128"), "a loopback address"),
    (("0.0.0.0/8", "::/128"), "an unspecified address"),
    (("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "fc00::/7", "fec0::/10"), "a private address"),
    (("169.254.0.0/16", "fe80::/10"), "a link-local address (the cloud metadata service's range)"),
    (("100.64.0.0/10",), "a shared (carrier-grade NAT) address"),
    (("192.0.0.0/24", "240.0.0.0/4", "100::/64", "64:ff9b:1::/48"), "a reserved address"),
    (("224.0.0.0/4", "ff00::/8"), "a multicast address"),
) for net in nets]
NAT64 = ipaddress.ip_network("64:ff9b::/96")
COMPATIBLE = ipaddress.ip_network("::/96")
Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def own_networks() -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    """The addresses of this node's interfaces, read now (they may change): the kernel's local routes (IPv4, from
    /proc/net/fib_trie) and interface addresses (IPv6, /proc/net/if_inet6)."""
    out: list = []
    with contextlib.suppress(OSError):
        previous = ""
        for line in Path("/proc/net/fib_trie").read_text().splitlines():
            words = line.split()
            if words[-2:] == ["host", "LOCAL"] and words[0].startswith("/") and previous:
                out.append(ipaddress.ip_network(f"{previous}{words[0]}", strict=False))
            elif len(words) == 2 and words[0] in ("|--", "+--"):
                previous = words[1]
    with contextlib.suppress(OSError):
        for line in Path("/proc/net/if_inet6").read_text().splitlines():
            raw = line.split()[0]
            out.append(ipaddress.ip_network(":".join(raw[i:i + 4] for i in range(0, 32, 4))))
    return out


def refusal(address: str | Address, allow=(), own: Sequence | None = None) -> str | None:
    """Why a connection to `address` is refused (None: an address outside REFUSED and not the node's own, or one
    the admin allows). `own`: the node's interface networks (None: `own_networks()`, read now)."""
    ip = ipaddress.ip_address(address.split("%", 1)[0]) if isinstance(address, str) else address
    if any(ip in net for net in allow if net.version == ip.version):
        return None
    candidates = [ip]
    if ip.version == 6:
        teredo = ip.teredo
        candidates += [a for a in (ip.ipv4_mapped, ip.sixtofour, teredo and teredo[1]) if a]
        if ip in NAT64 or (ip in COMPATIBLE and int(ip) > 1):
            candidates.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
    own = own_networks() if own is None else own
    own_hit = next((one for one in candidates if any(one in net for net in own if net.version == one.version)), None)
    for one in candidates:
        for net, what in REFUSED:
            if net.version == one.version and one in net:
                return f"{what} ({one})"
    if own_hit is not None:
        return f"an address of this node's own interfaces ({own_hit})"
    return None


def name_refusal(host: str) -> str | None:
    name = host.rstrip(".").lower()
    if name in BLOCKED_NAMES or name.endswith((".localhost", ".internal")):
        return f"the host name {name} is internal"
    return None


async def pick_address(host: str, port: int, allow=()) -> tuple[str | None, str | None]:
    """(address to connect to, None) or (None, why refused): every address `host` resolves to must pass."""
    why = name_refusal(host)
    if why:
        return None, why
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as e:
        return None, f"cannot resolve {host}: {e}"
    addresses = list(dict.fromkeys(info[4][0] for info in infos))
    own = own_networks()
    for address in addresses:
        why = refusal(address, allow, own)
        if why:
            return None, f"{host} resolves to {why}"
    return (addresses[0], None) if addresses else (None, f"{host} has no address")


class EgressProxy:
    """Serve `path` (a Unix socket) until `stop`: each connection is one proxied TCP connection."""

    def __init__(self, allow: Sequence[ipaddress.IPv4Network | ipaddress.IPv6Network] = ()) -> None:
        """`allow`: the admin's exceptions (the settings' egress_allow, $ROLLOUTD_EGRESS_ALLOW)."""
        self._server: asyncio.base_events.Server | None = None
        self._conns: set[asyncio.Task] = set()
        self._allow = list(allow)
        self.refused: list[str] = []  # what was refused, for the caller's log
        self.path: Path | None = None

    async def start(self, path: str | Path) -> None:
        # 0666: the sandbox's user, whatever its uid; the socket's directory keeps others out
        self._server = await asyncio.start_unix_server(self._track, sock=listening(path, 0o666), limit=HEAD_LIMIT)
        self.path = Path(path)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._conns):
            task.cancel()
        await asyncio.gather(*self._conns, return_exceptions=True)

    async def _track(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._conns) >= MAX_CONNECTIONS:
            _answer(writer, "503 Service Unavailable", f"egress: more than {MAX_CONNECTIONS} connections at once\n")
            writer.close()
            return
        task = asyncio.current_task()
        self._conns.add(task)
        try:
            await self._serve(reader, writer)
        finally:
            self._conns.discard(task)
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_SECONDS)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, asyncio.TimeoutError):
            return
        method, _, rest = head.split(b"\r\n", 1)[0].decode("latin-1").partition(" ")
        target = rest.rpartition(" ")[0]
        if method == "CONNECT":
            host, _, port = target.rpartition(":")
            host = host.strip("[]")
        else:
            url = urlsplit(target)
            host, port = url.hostname or "", str(url.port or 80) if url.scheme == "http" else ""
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            return
        address, why = await pick_address(host, int(port), self._allow)
        if address is None:
            if len(self.refused) < MAX_REFUSED_KEPT:
                self.refused.append(f"{host}:{port}: {why}")
            _answer(writer, "403 Forbidden", f"egress: {host}:{port} refused: {why}\n")
            return
        try:
            up_reader, up_writer = await asyncio.wait_for(asyncio.open_connection(address, int(port)), 30)
        except (OSError, asyncio.TimeoutError) as e:
            _answer(writer, "502 Bad Gateway", f"egress: cannot reach {host}:{port}: {e}\n")
            return
        if method == "CONNECT":
            writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        else:
            up_writer.write(head)
        try:
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        finally:
            up_writer.close()


def _answer(writer: asyncio.StreamWriter, status: str, body: str) -> None:
    data = body.encode()
    writer.write(b"HTTP/1.1 %s\r\nConnection: close\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n\r\n%s"
                 % (status.encode(), len(data), data))


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError, OSError):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()


@contextlib.contextmanager
def serving(path: Path, allow: Sequence[ipaddress.IPv4Network | ipaddress.IPv6Network] = ()) -> Iterator[EgressProxy]:
    """An `EgressProxy` on `path` served by a thread of its own (for synchronous callers: image builds)."""
    loop = asyncio.new_event_loop()
    proxy = EgressProxy(allow)
    loop.run_until_complete(proxy.start(path))
    thread = threading.Thread(target=loop.run_forever, name="egress", daemon=True)
    thread.start()
    try:
        yield proxy
    finally:
        asyncio.run_coroutine_threadsafe(proxy.stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()




__all__ = ["EgressProxy", "name_refusal", "own_networks", "pick_address", "refusal", "serving"]
