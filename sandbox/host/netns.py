"""`network: true`: the sandbox keeps its own network namespace and gets outbound NAT from slirp4netns.

Where it sits: `runtimes/bwrap.py` makes an `Outbound` for a spec with ``network: true`` and adds its
``--info-fd`` to bwrap's command line; the create template (`runtimes/base.py` `start`) calls `attach` once
the server is READY (bwrap has reported the sandbox's init pid and set up its loopback), before the sandbox is handed out.

slirp4netns (Debian package ``slirp4netns``) gives the namespace a ``tap0`` with 10.0.2.100/24, a default
route through 10.0.2.2 and a DNS forwarder at 10.0.2.3, in user space: the sandbox reaches the outside the
way a host process would, but never the host's loopback (``--disable-host-loopback``: a service listening
on the node's 127.0.0.1, another rollout's relay, the daemon's own ports). Its own loopback is its own.
Once the tap is up, `fence` writes routes into the namespace (``ip -batch`` through ``nsenter``): what the egress
proxy refuses (private, link-local with the cloud metadata service, shared, reserved, multicast; `egress.REFUSED`) and
every address of the node's own interfaces become ``prohibit`` routes (connect fails at once with "Permission
denied"), the admin's exceptions (`egress_allow`) routes out. The sandbox cannot undo them: its processes hold no
capability over the namespace. slirp4netns carries the sandbox's id in its environment (`footprint.reap_leftovers`
ends it with the sandbox) and exits when the daemon's end of ``--exit-fd`` closes (a daemon that dies takes it along).
Next step: the sandbox's own commands (``curl``, ``pip``) use the route.
"""
from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

from ..errors import SandboxCreateError
from ..launch import ID_VAR
from .egress import REFUSED, own_networks

ATTACH_TIMEOUT = 10.0
RESOLV_CONF = "nameserver 10.0.2.3\n"  # slirp4netns's DNS forwarder, inside the namespace
GATEWAY = "10.0.2.2"  # slirp4netns's router (its host-loopback alias is off)
LOCAL = [ipaddress.ip_network(n) for n in ("127.0.0.0/8", "0.0.0.0/8")]  # the sandbox's own, never routed out


def slirp_binary() -> str | None:
    return shutil.which("slirp4netns")


def missing() -> str | None:
    """Why `network: true` cannot be given here, or None."""
    if slirp_binary() is None:
        return "network: true needs slirp4netns (apt-get install slirp4netns; see .ci/system-packages.sh)"
    if shutil.which("nsenter") is None or not os.path.exists(_ip()):
        return ("network: true needs nsenter (util-linux) and ip (iproute2) to keep the sandbox off the node's own "
                "and private addresses (apt-get install iproute2)")
    if os.geteuid() != 0 and not os.access("/dev/net/tun", os.R_OK | os.W_OK):
        return "network: true needs /dev/net/tun, which this node's user cannot open (a root node can)"
    return None


class Outbound:
    """One sandbox's NAT: the pipes bwrap and slirp4netns talk through, and the slirp4netns process."""

    def __init__(self, sandbox_id: str, log: Path, allow: Sequence = ()) -> None:
        """`allow`: networks the sandbox may reach although the egress proxy would refuse them (`egress_allow`)."""
        self.sandbox_id = sandbox_id
        self.log = log
        self.allow = tuple(allow)
        self.info_r, self.info_w = os.pipe()   # bwrap writes {"child-pid": N} here
        self.exit_r, self.exit_w = os.pipe()   # slirp4netns exits when exit_w closes
        self.proc: asyncio.subprocess.Process | None = None

    def bwrap_args(self) -> list[str]:
        return ["--info-fd", str(self.info_w)]

    @property
    def pass_fds(self) -> tuple[int, ...]:
        return (self.info_w,)

    async def attach(self) -> None:
        """After bwrap has started: plug slirp4netns into the sandbox's namespace; returns once tap0 is up."""
        os.close(self.info_w)
        self.info_w = -1
        try:
            info = await asyncio.wait_for(asyncio.to_thread(_read_until, self.info_r, b"}"), ATTACH_TIMEOUT)
            pid = int(json.loads(info)["child-pid"])
        except (asyncio.TimeoutError, ValueError, KeyError, TypeError) as e:
            raise SandboxCreateError(f"network: bwrap did not report the sandbox's pid ({e!r})") from None
        finally:
            os.close(self.info_r)
            self.info_r = -1
        # unprivileged: enter the user namespace that owns the network namespace (bwrap's outer one: the
        # sandbox's init sits in a nested one)
        owner = _owning_userns(pid) if os.geteuid() != 0 else None
        try:
            await self._plug(pid, owner)
            await fence(pid, owner, self.allow, self.log)
        finally:
            if owner is not None:
                os.close(owner)

    async def _plug(self, pid: int, owner: int | None) -> None:
        ready_r, ready_w = os.pipe()
        argv = [slirp_binary(), "--configure", "--mtu=65520", "--disable-host-loopback",
                "--ready-fd", str(ready_w), "--exit-fd", str(self.exit_r)]
        keep = [ready_w, self.exit_r]
        if owner is not None:
            keep.append(owner)
            argv.append(f"--userns-path=/proc/self/fd/{owner}")
        try:
            with open(self.log, "ab") as log:
                self.proc = await asyncio.create_subprocess_exec(
                    *argv, str(pid), "tap0", stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log,
                    pass_fds=tuple(keep), env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", ID_VAR: self.sandbox_id},
                    start_new_session=True)
        except OSError as e:
            raise SandboxCreateError(f"network: cannot start slirp4netns: {e}") from None
        finally:
            for fd in (ready_w, self.exit_r):
                os.close(fd)
            self.exit_r = -1
        try:
            ready = await asyncio.wait_for(asyncio.to_thread(_read_until, ready_r, b"1"), ATTACH_TIMEOUT)
        except asyncio.TimeoutError:
            ready = b""
        finally:
            os.close(ready_r)
        if not ready.startswith(b"1"):
            raise SandboxCreateError(f"network: slirp4netns did not configure the sandbox's interface: "
                                     f"{self.log.read_text(errors='replace')[-500:]}")

    def close(self) -> None:
        """Let slirp4netns go (its exit fd closes) and kill it; idempotent."""
        for name in ("info_r", "info_w", "exit_r", "exit_w"):
            fd = getattr(self, name)
            if fd >= 0:
                os.close(fd)
                setattr(self, name, -1)
        if self.proc is not None and self.proc.returncode is None:
            try:
                self.proc.kill()
            except ProcessLookupError:
                pass


def fence_lines(allow: Sequence = (), own: Sequence | None = None) -> list[str]:
    """`ip -batch` lines: the egress proxy's refused IPv4 ranges and the node's own IPv4 addresses prohibited (the
    sandbox's loopback aside), the allowed networks routed through slirp4netns. IPv4 only: the tap has no IPv6."""
    own = own_networks() if own is None else own
    refused = {net for net, _ in REFUSED} | {net for net in own if net.version == 4}
    lines = [f"route add prohibit {net}" for net in sorted(n for n in refused if n.version == 4 and
                                                            not any(n.subnet_of(local) for local in LOCAL))]
    return lines + [f"route replace {net} via {GATEWAY} dev tap0" for net in allow if net.version == 4]


async def fence(pid: int, owner: int | None, allow: Sequence, log: Path) -> None:
    """Write `fence_lines` into `pid`'s network namespace (as the user namespace's root when unprivileged)."""
    why = missing()
    if why is not None:
        raise SandboxCreateError(why)
    argv = [shutil.which("nsenter"), f"--net=/proc/{pid}/ns/net"]
    # unprivileged: nsenter keeps its ids (setgroups is denied there); bwrap's outer namespace maps the daemon's uid
    # to its root, so `ip` runs with that namespace's capabilities
    if owner is not None:
        argv[1:1] = [f"--user=/proc/self/fd/{owner}", "--preserve-credentials"]
    script = "\n".join(fence_lines(allow)) + "\n"
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, _ip(), "-batch", "-", stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT, pass_fds=() if owner is None else (owner,),
            env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})
        out, _ = await asyncio.wait_for(proc.communicate(script.encode()), ATTACH_TIMEOUT)
    except (OSError, asyncio.TimeoutError) as e:
        raise SandboxCreateError(f"network: cannot write the sandbox's routes: {e!r}") from None
    if proc.returncode != 0:
        with open(log, "ab") as f:
            f.write(out)
        raise SandboxCreateError(f"network: the sandbox's routes were refused: {out.decode(errors='replace')[-300:]}")


def _ip() -> str:
    return shutil.which("ip") or "/usr/sbin/ip"  # /usr/sbin is not on every user's PATH


def _owning_userns(pid: int) -> int:
    """An fd of the user namespace owning `pid`'s network namespace (ioctl NS_GET_USERNS)."""
    import fcntl

    net = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        return fcntl.ioctl(net, 0xB701)
    except OSError as e:
        raise SandboxCreateError(f"network: cannot find the sandbox's user namespace: {e}") from None
    finally:
        os.close(net)


def _read_until(fd: int, end: bytes) -> bytes:
    """What the pipe brings up to `end` (or its EOF): the writer may keep it open."""
    out = b""
    while end not in out and (chunk := os.read(fd, 4096)):
        out += chunk
    return out
