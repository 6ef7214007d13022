"""The node side of the containment suite: one sandbox, the probe inside it, the host checked after.

Run by test_containment.py as a subprocess (as root, or as an unprivileged
user): ``python containment_driver.py RUNTIME OUT_JSON``. Prints nothing;
writes the probe's verdicts plus the host-side ones (did a write reach the
host, is anything left after close) to OUT_JSON.
"""
import asyncio
import json
import os
import secrets
import socket
import sys
from pathlib import Path

from rolloutd.crds.kit.settings import SandboxSettings
from rolloutd.sandbox import SandboxSpec, get_runtime
from rolloutd.sandbox.host.footprint import pids_with_id
from rolloutd.sandbox.launch import runtime_paths
from rolloutd.sandbox.host.limits import PIDS_HEADROOM

HERE = Path(__file__).resolve().parent
SPEC = {"memory_mb": 256, "processes": 48, "tmp_mb": 16, "file_size_mb": 8}
SECRETS = ["/etc/shadow", "/etc/gshadow", "/etc/sudoers", "/etc/munge/munge.key", "/etc/ssh/ssh_host_ed25519_key",
           "/etc/ssh/ssh_host_rsa_key", "/etc/ssl/private", "/etc/security/opasswd", "/root", "/home", "/srv",
           "/run/munge", "/var/run/munge", "/var/lib/munge"]


def host_paths() -> tuple[list[str], list[str]]:
    """(write targets, secrets) that exist on this host, from the test's environment."""
    data = os.environ["ROLLOUTD_DATA_DIR"]
    checkout = os.environ["PROBE_CHECKOUT"]
    writes = ["/", "/etc", "/usr", "/var", "/var/tmp", "/root", "/tmp", data, checkout, os.environ["HOME"]]
    reads = SECRETS + [f"{data}/token", f"{checkout}/README.md", f"{checkout}/.git", os.environ["HOME"]]
    return writes, reads


async def main(runtime: str, out: str) -> None:
    tag = secrets.token_hex(4)
    writes, reads = host_paths()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    spec = SandboxSpec(runtime=runtime, limits=SPEC)
    sb = await get_runtime(runtime, SandboxSettings.from_env()).create(spec)  # this script: a node's entry point
    results: dict[str, str] = {}
    try:
        await sb.write_file("probe.py", (HERE / "containment_probe.py").read_text())
        args = {"tag": tag, "runtime_paths": runtime_paths(), "write_targets": writes, "secrets": reads, "host_port": listener.getsockname()[1],
                "fork_cap": SPEC["processes"] + PIDS_HEADROOM + 8, "memory_bytes": SPEC["memory_mb"] << 20,
                "tmp_bytes": SPEC["tmp_mb"] << 20, "file_bytes": SPEC["file_size_mb"] << 20}
        r = await sb.bash(f"python3 probe.py '{json.dumps(args)}' /workspace/out.json", timeout=120)
        if r.exit_code != 0:
            raise SystemExit(f"the probe failed: {r.output}")
        results = json.loads((sb.workspace / "out.json").read_text())
        r = await sb.bash("echo still alive")
        results["sandbox usable after the escapes"] = "contained" if r.output == "still alive\n" else f"ESCAPED: {r.output}"
    finally:
        await sb.close()
        reached = [d for d in writes if os.path.exists(os.path.join(d, f"rolloutd-probe-{tag}"))]
        for d in reached:  # remove what an escape left on the host, whatever happened
            os.unlink(os.path.join(d, f"rolloutd-probe-{tag}"))
    results["host writes"] = f"ESCAPED: reached {reached}" if reached else "contained"
    left = pids_with_id(sb.id) + _pids_with_env(f"ROLLOUTD_PROBE={tag}")
    results["leftover processes"] = f"ESCAPED: {left}" if left else "contained"
    results["sandbox directory removed"] = f"ESCAPED: {sb.root} is left" if sb.root.exists() else "contained"
    Path(out).write_text(json.dumps(results))


def _pids_with_env(needle: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and needle.encode() in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                found.append(int(entry))
        except OSError:
            pass
    return found


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
