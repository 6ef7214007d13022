"""A persistent IPython kernel inside the sandbox, driven through jupyter_client.

Where it sits: the in-sandbox execution server (`server/main.py`) owns one
`IPythonKernel` and calls `execute` / `interrupt` from its request threads.
The kernel starts lazily on the first cell (jupyter_client and ipykernel are
imported only then: they cost ~0.3 s, which the server's start must not pay).
Transport is ZeroMQ over ``ipc`` sockets in a private runtime directory: no
TCP port is opened, even on the sandbox's own loopback.

A cell past its timeout is interrupted (SIGINT through the kernel manager); if
the kernel is still busy after a grace period it is restarted and the result
says so (its state is lost). A kernel that dies (``os._exit``, the memory
limit) is reported in the cell's error and restarted on the next cell.
"""
from __future__ import annotations

import os
import queue
import re
import threading
import time

GRACE = 3.0
ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]")


class IPythonKernel:
    def __init__(self, cwd: str, env: dict[str, str], runtime_dir: str, preexec_fn=None) -> None:
        self.cwd = cwd
        self.env = env
        self.runtime_dir = runtime_dir
        self.preexec_fn = preexec_fn
        self.km = None
        self.kc = None
        self._lock = threading.Lock()  # one cell at a time

    @property
    def running(self) -> bool:
        return self.km is not None

    def _start(self) -> None:
        from jupyter_client import KernelManager

        os.makedirs(self.runtime_dir, mode=0o700, exist_ok=True)
        env = dict(self.env)
        env.setdefault("IPYTHONDIR", os.path.join(self.runtime_dir, "ipython"))
        env.setdefault("JUPYTER_RUNTIME_DIR", self.runtime_dir)
        env.setdefault("MPLCONFIGDIR", os.path.join(self.runtime_dir, "mpl"))
        env.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
        # one malloc arena: ipykernel's threads would each reserve 64 MB of address
        # space, and the kernel would not start under a small RLIMIT_AS
        env.setdefault("MALLOC_ARENA_MAX", "1")
        km = KernelManager(
            kernel_name="python3",
            transport="ipc",
            ip=os.path.join(self.runtime_dir, "k"),
            connection_file=os.path.join(self.runtime_dir, f"kernel-{os.getpid()}.json"),
        )
        # the kernel spec says "python"; run it with this interpreter (the venv's)
        kwargs = {"cwd": self.cwd, "env": env}
        if self.preexec_fn is not None:
            kwargs["preexec_fn"] = self.preexec_fn
        km.start_kernel(**kwargs)
        kc = km.client()
        kc.start_channels()
        try:
            kc.wait_for_ready(timeout=60)
        except RuntimeError:
            kc.stop_channels()
            km.shutdown_kernel(now=True)
            raise
        self.km, self.kc = km, kc

    def shutdown(self) -> None:
        km, kc = self.km, self.kc
        self.km = self.kc = None
        if kc is not None:
            try:
                kc.stop_channels()
            except Exception:  # noqa: BLE001
                pass
        if km is not None:
            try:
                km.shutdown_kernel(now=True)
            except Exception:  # noqa: BLE001
                pass

    def interrupt(self) -> None:
        km = self.km
        if km is not None:
            km.interrupt_kernel()

    def execute(self, code: str, timeout: float) -> dict:
        with self._lock:
            if self.km is None or not self.km.is_alive():
                self.shutdown()
                self._start()
            return self._execute(code, timeout)

    def _execute(self, code: str, timeout: float) -> dict:
        kc, km = self.kc, self.km
        start = time.monotonic()
        msg_id = kc.execute(code, allow_stdin=False, stop_on_error=False)
        out = {
            "stdout": "",
            "stderr": "",
            "result": None,
            "error": None,
            "images": [],
            "timed_out": False,
            "kernel_restarted": False,
        }
        deadline = start + timeout
        interrupted_at = None
        while True:
            now = time.monotonic()
            if interrupted_at is None and now >= deadline:
                out["timed_out"] = True
                interrupted_at = now
                km.interrupt_kernel()
            if interrupted_at is not None and now >= interrupted_at + GRACE:
                self._restart()
                out["kernel_restarted"] = True
                out["error"] = (out["error"] or "") + (
                    "rolloutd: the cell did not stop after an interrupt; the kernel was restarted "
                    "(its state is lost)"
                )
                break
            wait = min(0.5, max(0.001, (interrupted_at + GRACE if interrupted_at else deadline) - now))
            try:
                msg = kc.get_iopub_msg(timeout=wait)
            except queue.Empty:
                if not km.is_alive():
                    self.shutdown()
                    out["kernel_restarted"] = True
                    out["error"] = (out["error"] or "") + (
                        "rolloutd: the kernel died (its state is lost); the next cell starts a new one"
                    )
                    break
                continue
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                key = "stderr" if content.get("name") == "stderr" else "stdout"
                out[key] += content.get("text", "")
            elif kind in ("execute_result", "display_data"):
                data = content.get("data", {})
                if "image/png" in data:
                    out["images"].append(data["image/png"].replace("\n", ""))
                text = data.get("text/plain")
                if text is not None:
                    if kind == "execute_result":
                        out["result"] = text
                    elif "image/png" not in data:
                        out["stdout"] += text + "\n"
            elif kind == "error":
                tb = "\n".join(content.get("traceback", [])) or (
                    f"{content.get('ename')}: {content.get('evalue')}"
                )
                out["error"] = ANSI.sub("", tb)
            elif kind == "status" and content.get("execution_state") == "idle":
                break
        out["duration"] = time.monotonic() - start
        return out

    def _restart(self) -> None:
        try:
            self.km.restart_kernel(now=True)
            self.kc.wait_for_ready(timeout=60)
        except Exception:  # noqa: BLE001 - fall back to a fresh start next time
            self.shutdown()

