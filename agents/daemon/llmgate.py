"""The node's side of the job's policy: `PolicyGate` (the version LLM requests carry, held during weight updates)
and `TrackedLLM` (one rollout's view of the shared backend: its in-flight request ids, for server-side aborts).

`heartbeat.Heartbeater` sets the gate from the controller's replies; `pipeline.Pipeline` hands each RUN a `TrackedLLM`.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from ..llm import LLMBackend, SamplingParams
from .. import spans as node_traces


class PolicyGate:
    """The node's view of the job's policy: the version new LLM requests are tagged with, and
    whether new requests must wait (the weights are being updated). The controller sets both
    through heartbeat replies and waits until `inflight` reaches 0 before it touches the weights,
    so no request ever spans two versions."""

    def __init__(self, version: int | str | None = None) -> None:
        self.version = version
        self.inflight = 0
        self.on_change: Callable[[], None] = lambda: None  # tell the controller soon (a heartbeat)
        self._open = asyncio.Event()
        self._open.set()

    def set(self, version: int | str | None, paused: bool) -> None:
        self.version = version if version is not None else self.version
        if paused and self._open.is_set():
            self._open.clear()
            self.on_change()  # report "held, N in flight" without waiting for the next beat
        elif not paused:
            self._open.set()

    @property
    def paused(self) -> bool:
        return not self._open.is_set()

    async def enter(self) -> int | str | None:
        while True:
            await self._open.wait()
            if self._open.is_set():  # still open after the wake-up
                self.inflight += 1
                return self.version

    def leave(self) -> None:
        self.inflight -= 1
        if self.inflight == 0 and self.paused:
            self.on_change()


class TrackedLLM:
    """Wraps the shared backend for one rollout: remembers which request ids are in flight, so a
    cancel can abort them server-side (`abort_in_flight`), holds new requests while the policy is
    being updated, and records the policy version of every turn."""

    def __init__(self, inner: LLMBackend, gate: PolicyGate | None = None) -> None:
        self.inner = inner
        self.gate = gate or PolicyGate()
        self.in_flight: set[str] = set()
        self.versions: list[int | str | None] = []

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, request_id: str):
        version = await self.gate.enter()
        self.in_flight.add(request_id)
        try:
            with node_traces.model_call(self.inner, prompt_ids, sampling, request_id, version) as span:
                started = time.monotonic()
                gen = await self.inner.generate(prompt_ids, sampling, request_id)
                node_traces.generated(span, gen, started)
            self.versions.append(version)
            return gen
        finally:
            self.in_flight.discard(request_id)
            self.gate.leave()

    async def abort(self, request_id: str) -> None:
        await self.inner.abort(request_id)

    def __getattr__(self, name: str) -> Any:  # model, max_model_len, ... of the shared backend
        return getattr(self.inner, name)
