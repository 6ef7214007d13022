"""The sandbox side of tenancy, played as the hostile tenant against real bwrap and the real exec server:
`sandbox.env` and `sandbox.mounts` cannot steer the server while it is root (issue 24, item 1), the network
of `network: true` is its own (item 8), and the CPU and workspace bounds hold (item 8).

Next step: tests/tenancy/test_sandbox_tenant_eval.py (the verifier's staging, through the harbor handler).
"""
from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from rolloutd.sandbox import SandboxSpec, get_runtime
from rolloutd.sandbox.errors import SandboxCreateError
from rolloutd.sandbox.launch import SANDBOX_PACKAGE

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bwrap is not installed (.ci/system-packages.sh)")

# What a tenant plants in a mount: each piece writes a canary naming its uid when anything loads it.
CANARY = "import os\nopen('/out/canary-{name}-%d' % os.getpid(), 'w').write(str(os.getuid()))\n"
# a shadowing `ctypes` (the server imports it to drop privileges): the canary, then the real module
SHADOW_CTYPES = CANARY.format(name="ctypes") + (
    "import sys\nsys.path[:] = [p for p in sys.path if not p.startswith('/evil')]\ndel sys.modules['ctypes']\n"
    "import ctypes\n")
PRELOAD_C = r"""
#include <stdio.h>
#include <unistd.h>
__attribute__((constructor)) static void canary(void) {
  char path[64]; snprintf(path, sizeof path, "/out/canary-preload-%d", (int)getpid());
  FILE *f = fopen(path, "w"); if (f) { fprintf(f, "%d", (int)getuid()); fclose(f); }
}
"""


async def _with_sandbox(spec: SandboxSpec, *commands: str) -> list[str]:
    sandbox = await get_runtime("bwrap").create(spec)
    try:
        return [(await sandbox.bash(c, timeout=30)).output for c in commands]
    finally:
        await sandbox.close()


def _plant(tmp_path: Path) -> tuple[Path, Path]:
    evil, out = tmp_path / "evil", tmp_path / "out"
    site = evil / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    (site / "encodings").mkdir(parents=True)
    (site / "encodings" / "__init__.py").write_text(CANARY.format(name="home"))  # PYTHONHOME's first import
    (evil / "ctypes.py").write_text(SHADOW_CTYPES)
    for name in ("sitecustomize", "usercustomize", "startup"):
        (evil / f"{name}.py").write_text(CANARY.format(name=name))
    (evil / "evil.pth").write_text("import os; open('/out/canary-pth-%d' % os.getpid(), 'w').write(str(os.getuid()))\n")
    user_site = evil / "userbase" / "lib" / site.name / "site-packages"
    user_site.mkdir(parents=True)
    (user_site / "usercustomize.py").write_text(CANARY.format(name="userbase"))
    if shutil.which("cc"):
        (evil / "preload.c").write_text(PRELOAD_C)
        subprocess.run(["cc", "-shared", "-fPIC", "-o", str(evil / "preload.so"), str(evil / "preload.c")], check=True)
    out.mkdir()
    for d in (tmp_path, evil, out):
        os.chmod(d, 0o777 if d == out else 0o755)  # the sandbox's own user (nobody, under a root node) reaches them
    return evil, out


ENVS = {
    "PYTHONPATH": {"PYTHONPATH": "/evil", "PYTHONSTARTUP": "/evil/startup.py", "PYTHONINSPECT": "1"},
    "PYTHONHOME": {"PYTHONHOME": "/evil"},
    "PYTHONUSERBASE": {"PYTHONUSERBASE": "/evil/userbase", "PYTHONNOUSERSITE": ""},
    "LD_PRELOAD": {"LD_PRELOAD": "/evil/preload.so", "LD_LIBRARY_PATH": "/evil"},
}


@pytest.mark.parametrize("case", sorted(ENVS))
def test_sandbox_env_and_a_mount_never_steer_the_server_while_it_is_root(tmp_path, case):
    """On the code before, the server (root, not yet dropped) imported the planted `ctypes` through PYTHONPATH,
    ran PYTHONHOME's `encodings` and loaded LD_PRELOAD's library: a root-owned canary. Now the server starts
    in a fixed environment (`python -I -S`) and the job's environment reaches the agent's processes only."""
    evil, out = _plant(tmp_path)
    if case == "LD_PRELOAD" and not (evil / "preload.so").exists():
        pytest.skip("no C compiler to build the preloaded library")
    env = ENVS[case]
    spec = SandboxSpec(env=env, mounts=[{"host_path": str(evil), "path": "/evil"},
                                        {"host_path": str(out), "path": "/out", "read_only": False}])
    name = next(iter(env))
    echoed, python = asyncio.run(_with_sandbox(spec, f'echo "${name}"', "id -u"))
    assert echoed.strip() == env[name]  # sandbox.env still reaches the agent's shell
    assert python.strip() != "0"
    by_root = sorted(p.name for p in out.iterdir() if p.stat().st_uid == 0 or p.read_text() == "0")
    assert by_root == [], f"loaded as root before the server dropped privileges: {by_root}"


def test_the_agents_own_processes_still_get_the_environment(tmp_path):
    """What the job sets is the agent's: its python imports the tenant's path (as the sandbox's user)."""
    evil, out = _plant(tmp_path)
    spec = SandboxSpec(env={"PYTHONPATH": "/evil"}, mounts=[{"host_path": str(evil), "path": "/evil"},
                                                       {"host_path": str(out), "path": "/out", "read_only": False}])
    (listing,) = asyncio.run(_with_sandbox(spec, f"{sys.executable} -c 'import sitecustomize' && ls /out"))
    assert "canary-sitecustomize" in listing
    assert all(p.stat().st_uid != 0 for p in out.iterdir())


def test_a_mount_over_what_the_server_runs_from_is_refused_naming_the_field(tmp_path):
    """The server's interpreter, packages and code, and the loader's files: a mount on, below or above them is
    refused with the field's name (on the code before, each was mounted over what the server imports as root)."""
    data = tmp_path / "data"
    data.mkdir()
    stdlib = os.path.dirname(os.__file__)
    for inside in (stdlib, f"{SANDBOX_PACKAGE}/server", os.path.dirname(SANDBOX_PACKAGE)):
        spec = SandboxSpec(mounts=[{"host_path": str(data), "path": "/data"}, {"host_path": str(data), "path": inside}])
        with pytest.raises(SandboxCreateError, match=r"spec\.sandbox\.mounts\[1\]\.path: .*exec server"):
            asyncio.run(_with_sandbox(spec, "true"))
    for inside in ("/usr/lib/python3", "/etc/ld.so.preload", "/usr/local/lib", "/etc", "/lib64", "/bin"):
        with pytest.raises(ValueError, match="exec server loads"):
            SandboxSpec(mounts=[{"host_path": str(data), "path": inside}])


# -- network: true -------------------------------------------------------------------------------------------
# "reached" only when the service's own bytes come back: libslirp 4.7 (Debian's) can finish the sandbox's handshake
# for a refused 10.0.2.2 with no host connection behind it (a stale errno read as "connect in progress"; newer
# libslirp sets EPERM), which a bare connect() took for a leak once in CI
PROBE = ("python3 -c \"import socket, sys\ns = socket.socket(); s.settimeout(3)\n"
         "try:\n    s.connect((sys.argv[1], int(sys.argv[2])))\n"
         "except OSError as e:\n    print('refused', e); sys.exit()\n"
         "try:\n    s.sendall(b'GET / HTTP/1.0\\r\\n\\r\\n'); data = s.recv(4096)\n"
         "except OSError as e:\n    data = b''\n"
         "print('reached' if data else 'refused: a handshake and no byte')\" {} {}")


class _Hello(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"host loopback")

    def log_message(self, *args):
        pass


@pytest.fixture
def host_loopback_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hello)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()


def _needs_slirp():
    if shutil.which("slirp4netns") is None:
        pytest.skip("slirp4netns is not installed (.ci/system-packages.sh)")


def test_a_network_sandbox_has_its_own_namespace_with_a_route_out_but_not_the_host_loopback(host_loopback_server):
    """On the code before, `network: true` was the host's network namespace: the sandbox reached a service on
    the node's 127.0.0.1. Now: a tap with a default route (slirp4netns), and neither 127.0.0.1 nor slirp's
    alias of the host's loopback (10.0.2.2, refused by slirp4netns itself: no packet leaves the node)."""
    _needs_slirp()
    port = host_loopback_server
    spec = SandboxSpec(network=True)
    loopback, alias, links, route = asyncio.run(_with_sandbox(
        spec, PROBE.format("127.0.0.1", port), PROBE.format("10.0.2.2", port),
        "tail -n +3 /proc/net/dev | cut -d: -f1", "cat /proc/net/route"))
    assert loopback.startswith("refused") and alias.startswith("refused"), (loopback, alias)
    assert [n for n in links.split() if n != "lo"], links  # an interface of its own besides lo
    assert any(line.split()[1] == "00000000" for line in route.splitlines()[1:]), route  # a default route


@pytest.fixture
def node_address_server():
    """A service the node runs on 0.0.0.0 and one of the node's own (non-loopback) IPv4 addresses."""
    from rolloutd.sandbox.host.egress import own_networks

    mine = [n.network_address for n in own_networks() if n.version == 4 and not n.network_address.is_loopback]
    if not mine:
        pytest.skip("this node has no IPv4 address besides loopback")
    server = ThreadingHTTPServer(("0.0.0.0", 0), _Hello)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield str(mine[0]), server.server_address[1]
    server.shutdown()


def test_a_network_sandbox_reaches_neither_the_node_s_own_addresses_nor_private_or_metadata_ranges(
        node_address_server):
    """On the code before, a service the node ran on 0.0.0.0 answered a `network: true` sandbox on the node's
    address (slirp4netns's NAT connects from the host like any process), and 169.254.169.254 (a cloud's metadata
    service) and the site's private ranges were routed out. Now each is a `prohibit` route in the sandbox's
    namespace (connect: "Permission denied" at once), and the sandbox cannot delete them."""
    _needs_slirp()
    address, port = node_address_server
    attack = "ip route del prohibit 169.254.0.0/16; ip route flush table main; echo rc=$?"
    # bound to the tap, the kernel skips the routes and takes the address as on the link: slirp4netns answers
    # ARP for its own network only, so nothing comes back
    bound = PROBE.replace("s.settimeout(3)", "s.settimeout(3); s.setsockopt(socket.SOL_SOCKET, 25, b'tap0')")
    own, metadata, private, undo, own_after, by_device, routes = asyncio.run(_with_sandbox(
        SandboxSpec(network=True), PROBE.format(address, port), PROBE.format("169.254.169.254", 80),
        PROBE.format("10.20.30.40", 80), attack, PROBE.format(address, port), bound.format(address, port),
        "ip route"))
    for seen in (own, metadata, private, own_after):
        assert seen.startswith("refused") and "Permission denied" in seen, seen
    assert by_device.startswith("refused"), by_device
    assert "Operation not permitted" in undo, undo
    assert f"prohibit {address} " in routes + " " and "prohibit 169.254.0.0/16" in routes, routes
    assert "default via 10.0.2.2 dev tap0" in routes  # the way out stays


def test_an_address_the_admin_allows_is_routed_out(node_address_server):
    """`egress_allow` (the site's mirror on a private network) is the exception for sandboxes as for builds."""
    import ipaddress

    from rolloutd.crds.kit.settings import SandboxSettings

    _needs_slirp()
    address, port = node_address_server
    settings = SandboxSettings(egress_allow=(ipaddress.ip_network(f"{address}/32"),))

    async def main():
        sandbox = await get_runtime("bwrap", settings).create(SandboxSpec(network=True))
        try:
            return (await sandbox.bash(PROBE.format(address, port), timeout=30)).output
        finally:
            await sandbox.close()

    assert asyncio.run(main()).startswith("reached")


def test_two_network_sandboxes_do_not_share_a_loopback():
    """Two rollouts' relays (agents/gateway/server.py, one port for all) met on the host's loopback before."""
    _needs_slirp()

    async def main():
        runtime = get_runtime("bwrap")
        a = await runtime.create(SandboxSpec(network=True))
        b = await runtime.create(SandboxSpec(network=True))
        try:
            # up once the port answers on this sandbox's own loopback (a loaded node starts python slowly)
            serve = ("nohup python3 -m http.server 41999 --bind 127.0.0.1 > /dev/null 2>&1 & "
                     "for i in $(seq 600); do (exec 3<>/dev/tcp/127.0.0.1/41999) 2>/dev/null && break; sleep 0.05; done;"
                     " (exec 3<>/dev/tcp/127.0.0.1/41999) 2>/dev/null && echo up || echo down")
            assert (await a.bash(serve)).output.strip() == "up"
            seen_from_a = (await a.bash(PROBE.format("127.0.0.1", 41999))).output
            seen_from_b = (await b.bash(PROBE.format("127.0.0.1", 41999))).output
            also_in_b = (await b.bash(serve + "; " + PROBE.format("127.0.0.1", 41999))).output
            return seen_from_a, seen_from_b, also_in_b, a.limits["network"]
        finally:
            await a.close()
            await b.close()

    seen_from_a, seen_from_b, also_in_b, kind = asyncio.run(main())
    assert seen_from_a.startswith("reached") and seen_from_b.startswith("refused"), (seen_from_a, seen_from_b)
    assert also_in_b.strip().endswith("reached")  # the same port is free in b: its own loopback
    assert kind == "slirp4netns"


# -- CPU and workspace bounds ----------------------------------------------------------------------------------
# two burners for one second of wall time: the cgroup's CPU time, at most 0.05 core, stays far below a core's. Each
# reports the CPU it got in that second (not the interpreter's start: on a loaded box that alone took 0.1-0.4 s) in one
# write(2), so the lines cannot interleave on the pty; the parent waits for its child's line
BURN = ("python3 -c \"import os, time\npid = os.fork()\nt, c = time.time(), time.process_time()\n"
        "while time.time() - t < 1.0: pass\n"
        "os.write(1, ('%f\\n' % (time.process_time() - c)).encode())\nif pid: os.waitpid(pid, 0)\"")


def test_the_cpu_bound_holds_where_the_node_may_create_cgroups():
    async def main():
        sandbox = await get_runtime("bwrap").create(SandboxSpec(limits={"cpus": 0.05}))
        try:
            if "cpu" not in sandbox.limits["cgroup"]:
                return sandbox.limits.get("cpu_skipped"), None, None
            used = [float(x) for x in (await sandbox.bash(BURN, timeout=30)).output.split()]
            stat = [(d / "cpu.stat").read_text() for d in sandbox._cgroup.dirs if (d / "cpu.stat").exists()]
            return None, used, stat
        finally:
            await sandbox.close()

    skipped, used, stat = asyncio.run(main())
    if skipped:
        assert skipped.startswith("no cgroup cpu controller")  # recorded, never silent
        pytest.skip(skipped)
    throttled = {k: int(v) for line in stat[0].splitlines() for k, v in [line.split()]}["nr_throttled"]
    assert len(used) == 2 and throttled > 0 and sum(used) < 0.3, (used, stat)  # a twentieth of a core: ~0.05 s of CPU per second


def test_the_workspace_bound_trips_with_a_clear_error():
    async def main():
        sandbox = await get_runtime("bwrap").create(SandboxSpec(limits={"workspace_mb": 4}))
        try:
            if "workspace_mb" not in sandbox.limits:
                return sandbox.limits.get("workspace_skipped"), None, None
            shell = (await sandbox.bash("head -c 8000000 /dev/zero > /workspace/big; echo rc=$?")).output
            with pytest.raises(Exception) as caught:
                await sandbox.write_file("/workspace/more", "x" * 6_000_000)
            return None, shell, str(caught.value)
        finally:
            await sandbox.close()

    skipped, shell, error = asyncio.run(main())
    if skipped:
        pytest.skip(skipped)
    assert "No space left on device" in shell and "rc=1" in shell
    assert "spec.sandbox.limits.workspaceMB" in error and "4 MB" in error
