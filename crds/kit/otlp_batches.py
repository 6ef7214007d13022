"""Finished spans queued in memory and sent in batches by a thread of their own, by the SDK exporter's HTTP client.

Fed by crds/kit/tracing.py (`finished`, `encoded`); each batch is encoded by crds/kit/otlp.py's `request` and sent by
the SDK exporter's own HTTP client (endpoint, headers, compression, timeout and TLS from the standard
`OTEL_EXPORTER_OTLP_*` variables), batched as `OTEL_BSP_*` say.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from rolloutd.crds.kit.otlp import Finished, request

log = logging.getLogger(__name__)


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


class Batches:
    """Finished spans queued in memory, encoded and sent by a thread of their own: when a batch is full
    (`OTEL_BSP_MAX_EXPORT_BATCH_SIZE`, 512) or every `OTEL_BSP_SCHEDULE_DELAY` ms (5000); past
    `OTEL_BSP_MAX_QUEUE_SIZE` (2048) spans waiting, new ones are dropped (counted), as the SDK's batch processor does.
    `send(data, timeout)`: True when sent; `timeout` None, or at a stop (`close`) the seconds it may take."""

    def __init__(self, send: Callable[[bytes, float | None], bool], resource: dict[str, Any], scope: str) -> None:
        self.send, self.resource, self.scope = send, resource, scope
        self.delay = _env_int("OTEL_BSP_SCHEDULE_DELAY", 5000) / 1000
        self.batch = max(_env_int("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512), 1)
        self.most = max(_env_int("OTEL_BSP_MAX_QUEUE_SIZE", 2048), self.batch)
        self.added = self.dropped = self.sent = self.failed = 0
        self._queue: deque[Finished | bytes] = deque()
        self._wake, self._idle, self._stop, self._flushing = threading.Event(), threading.Event(), False, False
        self.requests, self._all_at = 0, time.monotonic()
        self._closing: float | None = None   # `close`'s deadline (monotonic) once called
        self._failed_before = 0              # spans whose send had failed when `close` was called
        self._thread = threading.Thread(target=self._run, name="rolloutd-otlp", daemon=True)
        self._thread.start()

    def add(self, s: Finished | bytes) -> None:
        """Queue an ended span: a `Finished`, or its `Span` message already encoded (`encode`)."""
        self.added += 1
        if self._closing is not None:   # the process is stopping: the caller's thread sends, nothing dropped for room
            self._queue.append(s)
            if len(self._queue) >= self.batch:
                self._last(full=True)
            return
        if len(self._queue) >= self.most:
            if not self.dropped:   # once: the trace backend (or this process's share of the CPU) cannot keep up
                log.warning("%d spans wait to be sent (OTEL_BSP_MAX_QUEUE_SIZE): dropping new ones", self.most)
            self.dropped += 1
            return
        self._queue.append(s)
        if len(self._queue) % self.batch == 0:   # a batch is full: once, not on every span past it
            self._wake.set()

    def _drain(self, full: bool = False) -> bool:
        """Send what is queued in batches; `full`: only full ones (woken by a full batch: the spans that came while
        one was sent wait for the next, instead of going out in small requests right after, ~1 ms each). False when
        a send failed."""
        ok = True
        while len(self._queue) >= (self.batch if full else 1):
            self.requests += 1
            batch = [self._queue.popleft() for _ in range(min(self.batch, len(self._queue)))]
            try:
                left = None if self._closing is None else self._closing - time.monotonic()
                ok = self.send(request(self.resource, self.scope, batch), left)
            except Exception:  # noqa: BLE001 - a trace backend's failure never reaches the controller's work
                log.exception("exporting %d spans failed", len(batch))
                ok = False
            if ok:
                self.sent += len(batch)
            else:
                self.failed += len(batch)
        return ok

    def _run(self) -> None:
        while not self._stop:
            woken = self._wake.wait(self.delay)
            self._wake.clear()
            self._idle.clear()
            flushing, self._flushing = self._flushing, False
            # the rest too when flushing, stopping, at the schedule, or when the last such send is `delay` ago
            full = woken and not flushing and not self._stop and time.monotonic() - self._all_at < self.delay
            self._drain(full=full)
            if not full:
                self._all_at = time.monotonic()
            self._idle.set()

    def flush(self, timeout: float = 5.0) -> None:
        """Send what is queued now (a process about to exit): rounds until the queue is empty and the round that
        emptied it has sent (a round under way when called may have sent only full batches)."""
        if self._stop:   # closed: no thread to wake
            return self._last()
        deadline = time.monotonic() + timeout
        while True:
            self._idle.clear()
            self._flushing = True
            self._wake.set()
            self._idle.wait(max(deadline - time.monotonic(), 0))
            if not self._queue or time.monotonic() >= deadline:
                return

    def close(self, timeout: float = 5.0) -> None:
        """The process is stopping: the thread stops (its send under way finished), and from now on the spans
        added are sent by the caller's thread, a batch as soon as one is full, none dropped for room (a controller's
        stop ends every attempt in flight at once: up to two spans per slot of every node), until `timeout` has
        passed (each send is given what is left of it) or a send failed: later ones are counted as dropped.
        `shutdown` sends the rest."""
        if self._stop:
            return
        deadline = time.monotonic() + timeout
        self._stop = True
        self._wake.set()
        self._thread.join(timeout)   # it sends what is queued, the spans added meanwhile too
        self._failed_before, self._closing = self.failed, deadline

    def _last(self, full: bool = False) -> None:
        """`close`'s sends, in the caller's thread: the queue's batches (`full`: only full ones) while in time."""
        if (self._thread.is_alive() or self._closing is None or time.monotonic() >= self._closing
                or self.failed > self._failed_before):
            self.dropped += len(self._queue)   # the thread still sending (never joined), late, or the backend down
            self._queue.clear()
            return
        self._drain(full)

    def shutdown(self, timeout: float = 5.0) -> None:
        """Send what is queued and stop (`close` first when it was not called)."""
        self.close(timeout)
        self._last()

    def counts(self) -> str:
        return (f"{self.added} spans: {self.sent} sent in {self.requests} requests, {self.dropped} dropped, "
                f"{self.failed} not sent (the backend failed)")


def sdk_batches(resource: dict[str, Any], scope: str) -> Batches | bool:
    """`Batches` sending by the SDK exporter's HTTP client (the standard OTLP variables: endpoint, headers,
    compression, timeout, TLS; its retries), shut down at exit; False when this SDK's exporter has none."""
    import atexit

    client = getattr(sdk_exporter(), "_client", None)
    if client is None or not callable(getattr(client, "export", None)):
        return False

    def send(data: bytes, timeout: float | None) -> bool:
        if timeout is not None and isinstance(getattr(client, "_timeout", None), (int, float)):
            client._timeout = min(client._timeout, max(timeout, 0.05))   # a stop's sends: within its time left
        return bool(client.export(data).success)

    batches = Batches(send, resource, scope)
    atexit.register(batches.shutdown)
    return batches


def sdk_exporter() -> Any:
    """The SDK's OTLP/HTTP span exporter, on the SDK's own urllib3 transport when nothing the default `requests` one
    does beyond it applies (no proxy variable or ~/.netrc entry for the endpoint, the plain session, not a credential
    provider's): ~half its CPU per request (a 512-span request: 1.05 -> 0.46 ms, kept alive 0.67 -> 0.32 ms)."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    exporter = OTLPSpanExporter()
    try:
        import requests
        from opentelemetry.exporter.http.transport._urllib3 import Urllib3HTTPTransport
    except ImportError:   # another SDK: its default transport
        return exporter
    client = getattr(exporter, "_client", None)
    session = getattr(getattr(client, "_transport", None), "_session", None)
    endpoint = getattr(client, "_endpoint", None)
    if type(session) is not requests.Session or not isinstance(endpoint, str) or session.auth or session.proxies:
        return exporter
    # what requests would take from the environment on every request: proxies, a CA bundle; none may differ
    env = session.merge_environment_settings(endpoint, {}, None, session.verify, session.cert)
    if env["proxies"] or requests.utils.get_netrc_auth(endpoint):
        return exporter
    return OTLPSpanExporter(_transport=Urllib3HTTPTransport(verify=env["verify"], cert=env["cert"]))
