"""A Unix-socket relay in front of the test PostgreSQL server's socket, for a controller whose only way to its database
it is: `cut()` closes it and every connection through it (a lost database), `hold()` keeps every connection open but
forwards nothing until `release()` (a stalled one: a paused server, a network that drops and retransmits).

Used by tests/faults/test_failover.py (the leader cut off) and tests/faults/test_ui_database_stall.py."""
from __future__ import annotations

import socket
import threading
from pathlib import Path
from urllib.parse import parse_qs, urlparse

SOCKET = ".s.PGSQL.5432"


class PgRelay:
    def __init__(self, store_url: str, relay_dir: Path) -> None:
        """`store_url`: a postgresql:// URL on the test server's socket directory (`?host=DIR`)."""
        self.server_dir = parse_qs(urlparse(store_url).query)["host"][0]
        self.url = store_url.replace(self.server_dir, str(relay_dir))  # the same database, through this relay
        relay_dir.mkdir()
        self.listener = socket.socket(socket.AF_UNIX)
        self.listener.bind(str(relay_dir / SOCKET))
        self.listener.listen(64)
        self.open: list[socket.socket] = []
        self.cutting = False
        self.flowing = threading.Event()
        self.flowing.set()
        self.held = 0  # messages that arrived while held: each waits to be forwarded
        self.sent: list[bytes] = []  # the last messages sent to the server, newest last (`sent_with`)
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.cutting:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.socket(socket.AF_UNIX)
            upstream.connect(str(Path(self.server_dir) / SOCKET))
            self.open += [client, upstream]
            for a, b, log in ((client, upstream, True), (upstream, client, False)):
                threading.Thread(target=self._pump, args=(a, b, log), daemon=True).start()

    def _pump(self, a: socket.socket, b: socket.socket, log: bool) -> None:
        try:
            while data := a.recv(65536):
                if log:
                    with self._lock:
                        self.sent = [*self.sent[-999:], data]
                if not self.flowing.is_set():
                    with self._lock:
                        self.held += 1
                    self.flowing.wait()
                b.sendall(data)
        except OSError:
            pass

    def sent_with(self, text: bytes) -> int:
        """How many of the last messages sent to the server hold `text` (a statement's words)."""
        with self._lock:
            return sum(text in m for m in self.sent)

    def hold(self) -> None:
        self.flowing.clear()

    def release(self) -> None:
        self.flowing.set()

    def cut(self) -> None:
        self.cutting = True
        self.flowing.set()
        for s in [self.listener, *self.open]:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
