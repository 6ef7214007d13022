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
