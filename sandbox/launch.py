"""How the execution server is launched: its typed configuration and the command line that carries it.

Where it sits: a runtime (`runtimes/base.py`) fills a `LaunchConfig` and wraps `server_argv(config)`
in its own command line; inside the sandbox the launcher below hands the config to `server.main.main`.
"""
from __future__ import annotations

import functools
import importlib.util
import marshal
import os
import sys
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

SANDBOX_PACKAGE = str(Path(__file__).resolve().parent)  # holds the bare `server` package
# the config travels as marshal (a builtin: no json/re import before bash is forked)
LAUNCHER = (
    "import sys,marshal;c=marshal.loads(bytes.fromhex(sys.argv[1]));sys.path[:0]=c['path'][:1];"
    "from server.first_bash import fork_bash,become,interruptible;interruptible();become(c);b=fork_bash(c);"
    "sys.path+=c['path'][1:];from server.main import main;main(c,b)"
)


# The server's own environment, whatever the job says: it starts as root (a root node) and loads its
# interpreter before it drops privileges, so nothing of `sandbox.env` (LD_PRELOAD, PYTHONPATH, ...) may reach
# it; `-I -S` makes the interpreter ignore PYTHON* variables, the user site and site.py besides. The job's
# environment travels in `LaunchConfig.env`, applied to each session and kernel the server starts.
SERVER_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_CTYPE": "C.UTF-8"}
NODE_VARS = ("LD_LIBRARY_PATH",)  # the node's own (never the job's): an interpreter may need it to load at all
ID_VAR = "ROLLOUTD_SANDBOX_ID"  # set in every sandbox process; how leftovers are found (`host/footprint.py`)


def server_env(sandbox_id: str) -> dict[str, str]:
    """The server's environment: `SERVER_ENV`, the node's `NODE_VARS` and the sandbox's id (which
    `footprint.reap_leftovers` looks for)."""
    node = {k: os.environ[k] for k in NODE_VARS if os.environ.get(k)}
    return {**SERVER_ENV, **node, ID_VAR: sandbox_id}


class LaunchConfig(BaseModel):
    """What the server needs to know, with the paths as the sandbox sees them."""

    model_config = ConfigDict(extra="forbid")

    socket: str = Field(description="the Unix socket the node connects to (0600)")
    workspace: str = Field(description="the bash sessions' cwd; relative file paths resolve here")
    ctl_dir: str = Field(description="the control directory (socket; command files when /tmp is full)")
    runtime_dir: str | None = Field(None, description="the server's scratch directory (default: <ctl_dir>/rt)")
    env: dict[str, str] = Field(default_factory=dict, description="the environment of every bash session and kernel")
    rlimits: dict[str, int] = Field(default_factory=dict, description='"AS", "FSIZE", "NPROC" → value, set in every child')
    wall_seconds: float | None = Field(None, description="the server exits (124) this long after it starts")
    uid: int | None = Field(None, description="a root runtime's server drops to this uid first")
    gid: int | None = Field(None, description="... and this gid (default: the uid)")
    path: list[str] = Field(default_factory=list, description="sys.path: the server's parent, then its site dirs")


def server_site_dirs() -> list[str]:
    """Where the kernel's one third-party import, IPython (and what it imports), lives: bound into the sandbox."""
    spec = importlib.util.find_spec("IPython")
    if spec is None or spec.origin is None:
        return []
    return [str(Path(spec.origin).resolve().parent.parent)]


def runtime_paths() -> list[str]:
    """Host paths the execution server needs inside the sandbox (interpreter, packages): the
    outermost of the Python prefixes, this package and the server's site dirs."""
    paths = {
        os.path.realpath(sys.base_prefix),
        os.path.realpath(sys.prefix),
        SANDBOX_PACKAGE,
        *(os.path.realpath(p) for p in server_site_dirs()),
    }
    out = sorted(paths)
    return [p for p in out if not any(p != q and p.startswith(q + "/") for q in out)]


HOST_LIB = "/.rolloutd-host"  # where a root node binds its loader's directory for a root filesystem image


@functools.cache
def host_loader() -> str | None:
    """The host path of the dynamic loader the server's interpreter names (its ELF PT_INTERP); None when
    it cannot be read (not a 64-bit little-endian ELF)."""
    import struct

    try:
        with open(os.path.realpath(sys.executable), "rb") as f:
            head = f.read(64)
            if head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
                return None
            phoff, = struct.unpack_from("<Q", head, 32)
            phentsize, phnum = struct.unpack_from("<HH", head, 54)
            for i in range(phnum):
                f.seek(phoff + i * phentsize)
                kind, _, offset, _, _, size = struct.unpack("<IIQQQQ", f.read(40))
                if kind == 3:  # PT_INTERP
                    f.seek(offset)
                    return os.path.realpath(f.read(size).rstrip(b"\0").decode())
    except (OSError, struct.error, UnicodeDecodeError):
        return None
    return None


def host_loaded(argv: list[str]) -> list[str]:
    """`argv` (the server's) run by the host's own loader and libraries, bound at `HOST_LIB`: in a root
    filesystem image the server, still root, would otherwise load the image's loader, its
    /etc/ld.so.cache and its libraries (a tenant's Dockerfile builds them)."""
    loader = host_loader()
    if loader is None:
        return argv
    return [f"{HOST_LIB}/{os.path.basename(loader)}", "--inhibit-cache", "--library-path", HOST_LIB, *argv]


@functools.cache
def _compile_server() -> None:
    """Byte-compile the server once, here on the host: inside the sandbox the
    tree is read-only, so a stale .pyc would be recompiled at every start."""
    import compileall

    compileall.compile_dir(str(Path(SANDBOX_PACKAGE) / "server"), quiet=2)


def server_argv(config: LaunchConfig, python: str = sys.executable) -> list[str]:
    """The argv that starts the execution server with `config` (see server/main.py), in `SERVER_ENV`."""
    try:
        _compile_server()
    except OSError:
        pass
    wire = config.model_dump()
    wire["path"] = [SANDBOX_PACKAGE, *server_site_dirs()]
    return [python, "-I", "-S", "-c", LAUNCHER, marshal.dumps(wire).hex()]
