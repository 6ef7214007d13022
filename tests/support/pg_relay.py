"""A Unix-socket relay in front of the test PostgreSQL server's socket, for a controller whose only way to its database
it is: `cut()` closes it and every connection through it (a lost database); `hold_after(text)`, once a given
statement's transaction has ended, keeps every connection open but forwards nothing to the server until `release()`
(a stalled one: a paused server, a network that drops and retransmits).

Used by tests/faults/test_failover.py (the leader cut off) and tests/faults/test_database_stall_reads.py."""
from __future__ import annotations

import socket
import threading
from pathlib import Path
from urllib.parse import parse_qs, urlparse

SOCKET = ".s.PGSQL.5432"
TRANSACTION_ENDS = (b"ROLLBACK", b"COMMIT")


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
        self._hold_after: bytes | None = None
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
            threading.Thread(target=self._requests, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._answers, args=(upstream, client), daemon=True).start()

    def _requests(self, client: socket.socket, upstream: socket.socket) -> None:
        """The client's messages to the server: held while the relay holds. `armed`: this connection sent the
        `hold_after` text, so the end of its transaction starts the hold."""
        armed = False
        try:
            while data := client.recv(65536):
                with self._lock:
                    armed = armed or bool(self._hold_after and self._hold_after in data)
                    ends = armed and any(word in data for word in TRANSACTION_ENDS)
                    waits = not self.flowing.is_set() and not ends
                    self.held += waits
                if waits:
                    self.flowing.wait()
                upstream.sendall(data)
                if ends:
                    with self._lock:
                        self._hold_after, armed = None, False
                        self.flowing.clear()
        except OSError:
            pass

    def _answers(self, upstream: socket.socket, client: socket.socket) -> None:
        """The server's answers always go back: a held server answers what it already took, then nothing more."""
        try:
            while data := upstream.recv(65536):
                client.sendall(data)
        except OSError:
            pass

    @property
    def holding(self) -> bool:
        return not self.flowing.is_set()

    def hold_after(self, text: bytes) -> None:
        """Hold from the end of the next transaction whose statement holds `text` (its COMMIT or ROLLBACK goes
        through): the process that ran it is past its read before anything is held."""
        with self._lock:
            self._hold_after = text

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
