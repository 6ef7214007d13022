"""An ASGI app served by uvicorn on loopback in a thread of the test's own process.

The in-process stand-ins (`fake_controller`, `unstamped_engine`) start here and stop with `ThreadServer.stop`.
"""
from __future__ import annotations

import threading
import time

import uvicorn


class ThreadServer:
    """uvicorn in a daemon thread: `start` returns once it listens (or raises naming `what`); `stop` joins it."""

    def __init__(self, app, port: int, what: str, **config) -> None:
        self.what = what
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                                     lifespan="off", access_log=False, **config))
        self._thread = threading.Thread(target=self._server.run, name=what, daemon=True)

    def start(self, timeout: float = 10.0) -> "ThreadServer":
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"the {self.what} did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout)
