"""Tenancy, sandboxed image builds (issue 24, item 3): a tenant's Dockerfile against real builds, real bwrap and
the real egress proxy. A RUN step sees no host loopback and holds no capability on the host (its own user and
network namespaces); the proxy refuses loopback, private, link-local and metadata destinations, by address and
by name; links planted in the image (the user's home, /etc/group, WORKDIR, COPY targets) never lead the node to
a host path; the size bound stops a build. Images share the base under ~/.cache/rolloutd/images."""
from __future__ import annotations

import asyncio
import http.server
import json
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import pytest

from rolloutd.sandbox import SandboxSpec, get_runtime
from rolloutd.sandbox.image.build import build_image
from rolloutd.crds.kit.settings import SandboxSettings
from rolloutd.sandbox.image.rootfs import ImageBuildError, base_rootfs, image_cache_dir, lookup_user

SECRET = "host-loopback-secret-7f3a"

PROBE = r"""
import json, os, socket, sys, urllib.request
port = int(sys.argv[1])
def fetch(url, proxy):
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({"http": proxy} if proxy else {}))
    try:
        return opener.open(url, timeout=10).read().decode()
    except Exception as e:
        return f"error: {type(e).__name__}: {e}"
proxy = os.environ.get("http_proxy")
out = {"direct": fetch(f"http://127.0.0.1:{port}/", None),
       "proxied": fetch(f"http://127.0.0.1:{port}/", proxy),
       "proxied_by_name": fetch(f"http://localhost:{port}/", proxy),
       "uid_map": open("/proc/self/uid_map").read().split(),
       "userns": os.readlink("/proc/self/ns/user"), "netns": os.readlink("/proc/self/ns/net"),
       "interfaces": sorted(name for _, name in socket.if_nameindex())}
json.dump(out, sys.stdout)
"""


@pytest.fixture(scope="module")
def needs_builder():
    if shutil.which("bwrap") is None or shutil.which("mmdebstrap") is None or os.geteuid() != 0:
        pytest.skip("image builds need bwrap, mmdebstrap and root here (bash .ci/system-packages.sh)")


@pytest.fixture(scope="module")
def loopback_server():
    """An HTTP server on the host's loopback answering SECRET; `hits` counts what reached it."""
    hits = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            hits.append(self.path)
            body = SECRET.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_port, hits
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def canary():
    """A host directory the tenant names: <canary>/agent/which.txt says "host", <canary>/group names a group."""
    top = Path(tempfile.mkdtemp(prefix="rolloutd-canary-", dir="/var/tmp"))
    (top / "agent").mkdir()
    (top / "agent" / "which.txt").write_text("host\n")
    (top / "group").write_text("hostgroup:x:4242:\n")
    yield top
    shutil.rmtree(top, ignore_errors=True)


@pytest.fixture(scope="module")
def hostile(needs_builder, loopback_server, canary, tmp_path_factory):
    """One image built from a hostile Dockerfile: the probe, then links planted at the canary's host path."""
    port, _ = loopback_server
    ctx = tmp_path_factory.mktemp("hostile")
    (ctx / "probe.py").write_text(PROBE)
    dots = "/usr" + "/.." * 12 + f"{canary}/agent"  # `..` past the image's root, onto the host's canary
    (ctx / "Dockerfile").write_text(f"""\
FROM debian:bookworm
COPY probe.py /probe.py
RUN python3 /probe.py {port} > /probe.json 2>&1 || true
RUN mkdir -p {canary}/agent && echo image > {canary}/agent/which.txt
RUN useradd -m -d /homes/agent agent && rm -rf /homes && ln -s {canary} /homes
RUN useradd -M -u 1001 dots && sed -i 's|^dots:\\([^:]*:[^:]*:[^:]*:[^:]*\\):[^:]*:|dots:\\1:{dots}:|' /etc/passwd
RUN ln -s {canary} /app
COPY probe.py /app/copied.py
RUN cp /etc/group /etc/group.image && ln -sf {canary}/group /etc/group
WORKDIR /app/agent
""")
    return build_image(ctx, log=lambda m: None)


def _probe(image) -> dict:
    return json.loads((image.rootfs / "probe.json").read_text())


def test_a_run_step_never_reaches_the_hosts_loopback(hostile, loopback_server):
    """Neither directly nor through its proxy, by address or by name; nothing of the answer is in the image."""
    _, hits = loopback_server
    probe = _probe(hostile)
    assert hits == []
    for key in ("direct", "proxied", "proxied_by_name"):
        assert SECRET not in probe[key] and probe[key].startswith("error")
    assert "403" in probe["proxied"] and "403" in probe["proxied_by_name"]  # the proxy refused, by its filter
    assert SECRET not in (hostile.rootfs / "probe.json").read_text()


def test_a_run_step_holds_no_capability_on_the_host(hostile):
    """Its own user namespace (root there only) and network namespace (a loopback and nothing of the host's)."""
    probe = _probe(hostile)
    assert probe["userns"] != os.readlink("/proc/self/ns/user")
    assert probe["uid_map"] != ["0", "0", "4294967295"]  # not the host's (initial) user namespace
    assert probe["netns"] != os.readlink("/proc/self/ns/net")
    assert probe["interfaces"] == ["lo"]  # a packet socket there sees only the step's own loopback


def test_a_planted_home_link_never_copies_a_host_directory(hostile, canary):
    """/homes -> <canary> and a home of `/usr/../../..<canary>/agent`: the sandbox's HOME is the image's copy."""
    async def home_of(user: str) -> str:
        sandbox = await get_runtime("bwrap").create(SandboxSpec(image=str(hostile.rootfs), user=user))
        try:
            return (await sandbox.bash('cat "$HOME/which.txt" 2>&1; echo "home=$HOME"')).output
        finally:
            await sandbox.close()

    for user in ("agent", "dots"):
        out = asyncio.run(home_of(user))
        assert "host" not in out.split("home=")[0], (user, out)
        assert out.startswith("image"), (user, out)
    assert (canary / "agent" / "which.txt").read_text() == "host\n"


def test_a_planted_group_file_link_is_not_read_on_the_host(hostile):
    """/etc/group -> <canary>/group: the image has no such file, so no such group (never the host's file)."""
    with pytest.raises(ImageBuildError, match="group 'hostgroup' does not exist"):
        lookup_user(hostile.rootfs, "agent:hostgroup")


def test_workdir_and_copy_through_a_planted_link_stay_in_the_image(hostile, canary):
    """/app -> <canary>: COPY /app/copied.py and WORKDIR /app/agent land in the image's <canary>, never the host's."""
    assert not (canary / "copied.py").exists() and sorted(os.listdir(canary)) == ["agent", "group"]
    assert (canary / "agent" / "which.txt").read_text() == "host\n"
    inside = hostile.rootfs / str(canary).lstrip("/")
    assert (inside / "copied.py").is_file()
    assert not hostile.writable_workdir  # a WORKDIR through a link stays read-only (nothing moved on the host)


def test_a_mount_point_planted_as_a_link_stops_the_build(needs_builder, canary, tmp_path):
    """A step's mounts (here the build context's, for COPY) never go through a link the Dockerfile planted."""
    (tmp_path / "Dockerfile").write_text(f"FROM debian:bookworm\nRUN rm -rf /.rolloutd-context && "
                                         f"ln -s /oldroot{canary} /.rolloutd-context\nCOPY Dockerfile /x\n")
    with pytest.raises(ImageBuildError, match="Dockerfile:3: COPY: /.rolloutd-context is a link in the image"):
        build_image(tmp_path, log=lambda m: None)
    assert sorted(os.listdir(canary)) == ["agent", "group"]


def _size_context(tmp_path: Path, run: str) -> Path:
    (tmp_path / "Dockerfile").write_text(f"FROM debian:bookworm\nRUN {run}\n")
    return tmp_path


def _limit_mb(extra: int) -> int:
    from rolloutd.sandbox.image.build_step import tree_bytes
    return (tree_bytes(base_rootfs(image_cache_dir(SandboxSettings().images), log=lambda m: None)) >> 20) + extra


def test_the_size_bound_stops_a_step_that_keeps_writing(needs_builder, tmp_path):
    """Many small files, then a long sleep: the step is stopped while it runs, the error names the limit."""
    limit = _limit_mb(24)
    settings = SandboxSettings.from_env({"ROLLOUTD_IMAGE_MAX_MB": str(limit)})  # the node's, as its daemon reads it
    ctx = _size_context(tmp_path, "for i in $(seq 12); do head -c 4M /dev/urandom > /fill$i; done; sleep 300")
    t0 = time.monotonic()
    with pytest.raises(ImageBuildError) as err:
        build_image(ctx, log=lambda m: None, settings=settings)
    assert time.monotonic() - t0 < 200
    assert f"size limit of {limit} MB" in str(err.value) and "Dockerfile:2" in str(err.value)
    assert "ROLLOUTD_IMAGE_MAX_MB" in str(err.value)


def test_the_size_bound_stops_one_big_file(needs_builder, tmp_path):
    """One file larger than the whole bound (RLIMIT_FSIZE, or the check while the step runs, whichever first)."""
    limit = _limit_mb(16)
    ctx = _size_context(tmp_path, f"head -c {(limit + 8) << 20} /dev/zero > /big; sleep 300")
    with pytest.raises(ImageBuildError, match=f"size limit of {limit} MB"):
        build_image(ctx, log=lambda m: None, max_mb=limit)
