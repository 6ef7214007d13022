"""The IPython kernel process: one `InteractiveShell`, cells in and results out as JSON lines over two pipes.

Where it sits: `kernel.IPythonKernel` (in the exec server) starts this file with the sandbox's Python,
environment, cwd and limits, the request pipe's read end as fd 3 and the reply pipe's write end as fd 4.
No ZeroMQ, no ipykernel, no jupyter_client on either side: they cost ~20 MB in the server and ~20 MB more
in the kernel than IPython itself (bench/bench_density.py). Next step: the same shell built once in a
per-node template and forked into each sandbox (copy-on-write), see the benchmarks page.

    → {"id": 7, "code": "x = 1\\nx"}
    ← {"id": 7, "stdout": "", "stderr": "", "result": "1", "error": null, "images": []}

The first line written is ``{"ready": true}`` (or ``{"fatal": "..."}`` when IPython cannot be imported).
What the process writes to its fds 1 and 2 (``print``, ``!ls``, a subprocess, C code) lands in two
memory files read back after each cell, in the order written. Everything here runs as the sandbox's
user inside the sandbox: the kernel is the agent's own process.
"""
from __future__ import annotations

import base64
import json
import os
import re
import signal
import sys

REQUESTS, REPLIES = 3, 4
ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]")


class Cell:
    """What one cell produced besides its output streams."""

    def __init__(self) -> None:
        self.result: str | None = None
        self.error: str | None = None
        self.images: list[str] = []
        self.text: list[str] = []  # text/plain of display() calls without an image


def _png(data) -> str:
    return base64.b64encode(data).decode() if isinstance(data, bytes) else str(data).replace("\n", "")


def build_shell():
    """The shell, with its output hooks pointed at the current `Cell` (``shell.rolloutd_cell``)."""
    from IPython.core.displayhook import DisplayHook
    from IPython.core.displaypub import DisplayPublisher
    from IPython.core.interactiveshell import InteractiveShell

    class Hook(DisplayHook):
        def write_output_prompt(self) -> None:
            pass

        def write_format_data(self, format_dict, md_dict=None) -> None:
            cell = self.shell.rolloutd_cell
            if "image/png" in format_dict:
                cell.images.append(_png(format_dict["image/png"]))
            cell.result = format_dict.get("text/plain")

        def finish_displayhook(self) -> None:
            pass

    class Publisher(DisplayPublisher):
        def publish(self, data, metadata=None, source=None, *, transient=None, update=False, **kwargs) -> None:
            cell = self.shell.rolloutd_cell
            if "image/png" in data:
                cell.images.append(_png(data["image/png"]))
            elif "text/plain" in data:
                cell.text.append(data["text/plain"])

    class Shell(InteractiveShell):
        displayhook_class = Hook
        display_pub_class = Publisher

        def _showtraceback(self, etype, evalue, stb) -> None:
            self.rolloutd_cell.error = ANSI.sub("", "\n".join(stb))

    from traitlets.config import Config

    config = Config()
    # no history database: it would be a SQLite file and a thread in every sandbox, thrown away with it
    # (In, Out, _i1 and %history of this session work from memory)
    config.HistoryManager.enabled = False
    shell = Shell.instance(colors="nocolor", config=config)
    shell.rolloutd_cell = Cell()
    return shell


class Streams:
    """fds 1 and 2 as two memory files; `take` returns what each got since the last call."""

    def __init__(self) -> None:
        self.fds = []
        for target, name in ((1, "stdout"), (2, "stderr")):
            fd = os.memfd_create(f"rolloutd-{name}")
            os.dup2(fd, target)
            os.close(fd)
            self.fds.append(target)
        sys.stdout = open(1, "w", encoding="utf-8", errors="replace", buffering=1, closefd=False)
        sys.stderr = open(2, "w", encoding="utf-8", errors="replace", buffering=1, closefd=False)

    def take(self) -> tuple[str, str]:
        sys.stdout.flush()
        sys.stderr.flush()
        out = []
        for fd in self.fds:
            size = os.lseek(fd, 0, os.SEEK_END)
            data = os.pread(fd, size, 0) if size else b""
            os.ftruncate(fd, 0)
            os.lseek(fd, 0, os.SEEK_SET)
            out.append(data.decode("utf-8", "replace"))
        return out[0], out[1]


def run_cell(shell, streams: Streams, code: str) -> dict:
    """Run `code`. SIGINT is blocked except while the cell runs and while `serve` waits for the next
    request (a late interrupt is dropped there): an interrupt never cuts a request or a reply."""
    cell = shell.rolloutd_cell = Cell()
    try:
        try:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
            shell.run_cell(code, store_history=True)
        finally:
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    except KeyboardInterrupt:  # between IPython's own handlers
        cell.error = (cell.error or "") + "KeyboardInterrupt"
    stdout, stderr = streams.take()
    stdout += "".join(t + "\n" for t in cell.text)
    return {"stdout": stdout, "stderr": stderr, "result": cell.result, "error": cell.error, "images": cell.images}


def reply(obj: dict) -> None:
    view = memoryview((json.dumps(obj) + "\n").encode())
    while view:
        view = view[os.write(REPLIES, view):]


def serve(shell, streams: Streams) -> None:
    pending = b""
    while True:
        if b"\n" not in pending:
            try:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
                chunk = os.read(REQUESTS, 65536)
                signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            except KeyboardInterrupt:  # an interrupt that came after its cell ended
                continue
            if not chunk:
                return  # the server is gone
            pending += chunk
            continue
        line, pending = pending.split(b"\n", 1)
        request = json.loads(line)  # the server's own
        reply({"id": request["id"], **run_cell(shell, streams, request["code"])})


def main() -> None:
    if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
        sys.path[0] = ""  # the cwd first, as in any IPython kernel; not the server's own modules
    os.set_inheritable(REQUESTS, False)
    os.set_inheritable(REPLIES, False)
    streams = Streams()
    try:
        shell = build_shell()
    except ImportError as e:
        reply({"fatal": f"{e}"})
        return
    reply({"ready": True})
    serve(shell, streams)


if __name__ == "__main__":
    main()
