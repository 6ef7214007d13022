"""The node's side of the job's policy: `PolicyGate` (the version LLM requests carry, held during weight updates)
and `TrackedLLM` (one rollout's view of the shared backend: its in-flight request ids, for server-side aborts).

`heartbeat.Heartbeater` sets the gate from the controller's replies; `pipeline.Pipeline` hands each RUN a `TrackedLLM`,
whose generations carry their run-length versions (`Generation.versions`) for the agent loop's `versionSpans`.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from .. import spans as node_traces
from ..llm import BackendError, Generation, LLMBackend, Preempted, SamplingParams
from .prefillgate import PrefillGate
from .rategate import RateGate
from .tokengate import TokenGate
from .weightstamps import joined, stamped_versions

log = logging.getLogger("rolloutd.node")
# abort mode: how long an aborted request waits to hear of the update that aborted it (a beat or two)
UPDATE_NOTICE_SECONDS = 5.0
# drain mode: one call in this many streams, its time to first token measured (a stream costs a chunk per token)
TIMED_EVERY = 64


class Stream:
    """One streamed generation in flight: the tokens received so far and, per keep-mode fence, where it stood.
    Abort mode (and keep mode on an engine that does not stamp its tokens): `abort` stops its current request on the
    engine; `parked` while it waits, aborted, for the update; `fenced` once a keep-mode fence aborted it."""

    def __init__(self, url: str | None) -> None:
        self.url = url
        self.abort: Callable[[], Awaitable[None]] | None = None
        self.parked = False
        self.fenced = False
        self.received = 0
        self.marks: list[int] = []  # token counts at fences whose new version is not known yet
        self.runs: list[tuple[Any, int]] = []  # (version, tokens) settled so far
        self.stamped: Callable[[], bool] = lambda: False  # the engine stamps its tokens: no quiet wait at a fence

    def got(self, n: int) -> None:
        self.received += n


class PolicyGate:
    """The node's view of the job's policy: the version new LLM requests are tagged with, whether new
    requests must wait (the weights are being updated), the backends that failed to load the current version
    (they still run an older one), and the fence of a keep or abort update (`fence_asked`/`fence_done`): the
    controller has paused the engines (keep: requests in place; abort: aborted) and asks where each in-flight
    stream stands."""

    def __init__(self, version: int | str | None = None) -> None:
        self.version = version
        self.mode = "drain"  # the job's spec.policy.updateMode
        self.inflight = 0
        self.drain_calls = 0  # drain-mode calls begun: every TIMED_EVERY-th streams (`TrackedLLM.streams`)
        self.backend_versions: dict[str, Any] = {}
        self.fence_asked = 0
        self.fence_done = 0
        self.job_uid: str | None = None  # set when the controller labels every update (feature weight-stamps)
        self.streams: set[Stream] = set()
        self.on_change: Callable[[], None] = lambda: None  # tell the controller soon (a heartbeat)
        self._open = asyncio.Event()
        self._open.set()
        self._held = asyncio.Event()  # set while the gate holds (what `wait_paused` waits for, not a 20 ms poll)
        self._moved = asyncio.Event()  # a stream parked or ended: what the fence waits for
        self._fencing: asyncio.Task | None = None
        self.tokens = TokenGate()  # the job's share of each backend's tokens in flight (feature token-share)
        self.rates = RateGate()  # the job's share of each backend's processed tokens per second (feature work-share)
        self.prefill = PrefillGate()  # the node's long prompts awaiting their prefill: one per backend at a time

    def version_of(self, url: str | None) -> Any:
        """The version the backend at `url` runs (the job's, unless it failed to load that one)."""
        return self.backend_versions.get(url, self.version) if url else self.version

    def set(self, version: int | str | None, paused: bool, fence: int = 0,
            backend_versions: dict[str, Any] | None = None) -> None:
        self.version = version if version is not None else self.version
        if backend_versions is not None:
            self.backend_versions = dict(backend_versions)
        if fence > self.fence_asked:
            self.fence_asked = fence
            self._fencing = asyncio.get_running_loop().create_task(self._fence(fence))
        if paused and self._open.is_set():
            self._open.clear()
            self._held.set()
            self.on_change()  # report "held, N in flight" without waiting for the next beat
        elif not paused and not self._open.is_set():
            for s in self.streams:  # the update is over: tokens after each fence are the backend's new version
                for mark in s.marks:
                    settle(s, mark)
                    s.runs.append((self.version_of(s.url), 0))
                s.marks.clear()
            self._held.clear()
            self._open.set()

    async def _fence(self, epoch: int) -> None:
        """The engines are paused. abort mode: abort every stream's current request (the engine aborted those it ran;
        this also stops those that reached it after the pause, queued there). keep mode: a stream the engine stamps
        (`Stream.stamped`) stays in place, its split read from the stamps when it ends (its mark here is the fallback);
        a stream it does not stamp is aborted as in abort mode, since where its tokens stood at the pause cannot be
        proven from the outside (tokens arrive seconds after the engine made them on a loaded box). Then wait until
        every aborted stream is parked with its tokens so far (its split, exact) or ended."""
        started = time.monotonic()
        if self.mode == "abort":
            cut = [s for s in self.streams if s.abort is not None and not s.parked]
        else:
            cut = [s for s in self.streams if s.abort is not None and not s.parked and not s.stamped()]
            for s in self.streams:
                if s not in cut:
                    s.marks.append(s.received)
            for s in cut:
                s.fenced = True
        kept = len(self.streams) - len(cut)
        await asyncio.gather(*(s.abort() for s in cut), return_exceptions=True)
        deadline = time.monotonic() + 60  # bounded
        while time.monotonic() < deadline:
            self._moved.clear()
            if all(s.parked or s not in self.streams for s in cut):
                break
            with contextlib.suppress(TimeoutError):  # woken by each park or end (`moved`), checked twice a second
                await asyncio.wait_for(self._moved.wait(), 0.5)
        self.fence_done = max(self.fence_done, epoch)
        log.info("fence %d taken in %.3f s: %d stream(s) kept in place, %d cut and parked", epoch,
                 time.monotonic() - started, kept, len(cut))
        self.on_change()

    @property
    def paused(self) -> bool:
        return not self._open.is_set()

    async def wait_open(self) -> None:
        await self._open.wait()

    async def wait_paused(self, timeout: float) -> None:
        """Until the gate is held, `timeout` seconds at most."""
        if not self.paused:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._held.wait(), timeout)

    def moved(self) -> None:
        """A stream parked or ended (the fence waits for the ones it aborted)."""
        self._moved.set()

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


def settle(s: Stream, upto: int) -> None:
    """Extend the stream's last run to `upto` tokens in all."""
    version, n = s.runs[-1]
    s.runs[-1] = (version, n + upto - sum(c for _, c in s.runs))


class TrackedLLM:
    """Wraps the shared backend for one rollout: remembers which request ids are in flight, so a
    cancel can abort them server-side (`abort_in_flight`), holds new requests while the policy is
    being updated, and records the policy version of every turn and of every generated token.

    `mode` is the job's `spec.policy.updateMode`: in drain mode a call runs on one version (but for another job's
    update of a shared backend); in keep and abort mode a weight update that lands mid-generation splits it exactly
    (see `_split`). A call streams where that is needed or to be timed (`streams`), and only a streamed call's time to
    first token is measured (`Generation.first_token_seconds`)."""

    def __init__(self, inner: LLMBackend, gate: PolicyGate | None = None, *, mode: str = "drain",
                 url: str | None = None) -> None:
        self.inner = inner
        self.gate = gate or PolicyGate()
        self.mode = mode
        self.url = url
        self.in_flight: set[str] = set()
        self.versions: list[int | str | None] = []
        self.calls = 0  # model calls started: the rollout's turn, for the in-flight view (beat-turns)

    gated = True  # the gateway streams through `generate(on_tokens=…)`, never around the gate

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, request_id: str,
                       on_tokens: Callable[[list[int]], Awaitable[None]] | None = None) -> Generation:
        """One model call through the gate. `on_tokens` (the gateway's streamed answer): each run of ids as it
        arrives, as `gateway.Gateway.generate` hands them on, all but the finishing piece."""
        self.calls += 1
        await self.gate.tokens.fresh(self.url)  # a backend no beat's reply named yet: wait for one (its shares)
        async with (self.gate.prefill.slot(self.url, len(prompt_ids)) as prefilled,  # one long prefill queued
                    self.gate.rates.slot(self.url, len(prompt_ids)) as charge,  # the job's share of the work
                    self.gate.tokens.slot(self.url, len(prompt_ids) + sampling.max_tokens)):  # ... of tokens in flight
            gen, stream = await self._call(prompt_ids, sampling, request_id, on_tokens, prefilled)
            if charge is not None:
                charge.done(len(gen.token_ids), gen.cached_tokens)
        while stream.marks:  # a fence was taken and the update has not ended yet: its new version is unknown
            await self.gate.wait_open()
            if stream.marks:  # the gate opened before this stream left it: settle here
                for mark in stream.marks:
                    settle(stream, mark)
                    stream.runs.append((self.gate.version_of(self.url), 0))
                stream.marks.clear()
        settle(stream, len(gen.token_ids))
        gen.versions = []
        if self.stamped() and gen.weight_spans is not None and self.gate.job_uid is not None:
            gen.versions = stamped_versions(gen.weight_spans, self.gate.job_uid, stream.runs[0][0],
                                            self.gate.version_of(self.url))
        else:
            for v, n in stream.runs:  # runs of one version merged (a backend that kept its version), empty ones out
                if n > 0 and gen.versions and gen.versions[-1][0] == v:
                    gen.versions[-1] = (v, gen.versions[-1][1] + n)
                elif n > 0:
                    gen.versions.append((v, n))
        self.versions.append(gen.versions[0][0] if gen.versions else stream.runs[0][0])
        return gen

    async def _call(self, prompt_ids: list[int], sampling: SamplingParams, request_id: str,
                    on_tokens: Callable[[list[int]], Awaitable[None]] | None,
                    prefilled: Callable[[], None] = lambda: None) -> tuple[Generation, Stream]:
        """The call through the policy gate (held during weight updates), counted in flight there; `prefilled` at
        its first token (a plain request's ends with the call)."""
        await self.gate.enter()
        stream = Stream(self.url)
        stream.runs.append((self.gate.version_of(self.url), 0))
        stream.stamped = self.stamped
        self.gate.streams.add(stream)
        try:
            with node_traces.model_call(self.inner, prompt_ids, sampling, request_id, stream.runs[0][0]) as span:
                started = time.monotonic()
                streamed = self.streams(on_tokens, len(prompt_ids))
                if streamed or getattr(self.inner, "stamps", None) is True:  # stamped: split where an update lands
                    gen = await self._split(stream, prompt_ids, sampling, request_id, started, on_tokens, streamed,
                                            prefilled)
                else:
                    self.in_flight.add(request_id)
                    gen = await self.inner.generate(prompt_ids, sampling, request_id)
                    stream.got(len(gen.token_ids))
                node_traces.generated(span, gen, started)
        finally:
            self.in_flight.discard(request_id)
            self.gate.streams.discard(stream)
            self.gate.moved()
            self.gate.leave()
        return gen, stream

    def streams(self, on_tokens: Callable[[list[int]], Awaitable[None]] | None = None, prompt: int = 0) -> bool:
        """Whether the next call streams, when the backend can: always in keep and abort mode (the split of an update
        mid-call), for the gateway's streamed answers (`on_tokens`), on an engine not probed yet (the stream probes
        whether it stamps) and for a long prompt (its first token passes the prefill gate's turn on, not its end);
        else, in drain mode, one call in TIMED_EVERY of the job's, to measure the time to first token. The others are
        one plain request each (a stream costs the engine and this daemon a chunk per token:
        bench/results/RESULTS-pipeline.md), on an engine that stamps its tokens through its token endpoint, whose
        answer carries the stamps (another job's update of a shared backend splits the call: docs/content/async.md).
        Asking counts a drain-mode call."""
        if not hasattr(self.inner, "stream"):
            return False
        if self.mode != "drain" or on_tokens is not None or getattr(self.inner, "stamps", None) is None:
            return True
        if self.gate.prefill.holds(prompt):
            return True
        self.gate.drain_calls += 1
        return self.gate.drain_calls % TIMED_EVERY == 0

    def stamped(self) -> bool:
        """The engine stamps this call's tokens with labels the controller set at every update (exact versions)."""
        return self.gate.job_uid is not None and getattr(self.inner, "stamps", None) is True

    async def _split(self, stream: Stream, prompt_ids: list[int], sampling: SamplingParams,
                     request_id: str, started: float,
                     on_tokens: Callable[[list[int]], Awaitable[None]] | None = None,
                     streamed: bool = True, prefilled: Callable[[], None] = lambda: None) -> Generation:
        """Stream the generation (or, not `streamed`, one plain stamped request per part), counting its tokens, and
        call `prefilled` at its first token (a plain one's ends with the call). An abort by the server while the gate
        is held (abort mode: the controller aborted it to load new weights) keeps the tokens so far, waits for the
        update to end and continues from prompt + those tokens on the backend's new version: the split is exact by
        construction."""
        ids: list[int] = []
        logprobs: list[float] = []
        finish, stop_reason, cached, part = "", None, None, 0
        stamps: list[tuple[int, list[tuple[str, int, int]] | None]] = []  # per request: (tokens before it, stamps)
        first: float | None = None  # seconds from `started` to the first generated token
        while True:
            rid = request_id if part == 0 else f"{request_id}-c{part}"
            left = sampling.max_tokens - len(ids)
            if left <= 0:
                finish = "length"
                break
            update: dict[str, Any] = {"max_tokens": left}
            if sampling.min_tokens:
                update["min_tokens"] = max(sampling.min_tokens - len(ids), 0)
            self.in_flight.add(rid)
            stream.abort = lambda rid=rid: self.inner.abort(rid)
            stamps.append((len(ids), None))
            try:
                pieces = (self.inner.stream if streamed else self._whole)(
                    list(prompt_ids) + ids, sampling.model_copy(update=update), rid)
                async for piece in pieces:
                    if first is None and streamed and piece.token_ids:
                        first = time.monotonic() - started
                        prefilled()
                    ids += piece.token_ids
                    logprobs += piece.logprobs
                    stream.got(len(piece.token_ids))
                    finish, stop_reason = piece.finish_reason or finish, piece.stop_reason
                    cached = cached if piece.cached_tokens is None else piece.cached_tokens
                    if piece.weight_spans is not None:
                        stamps[-1] = (stamps[-1][0], piece.weight_spans)
                    if on_tokens is not None and not piece.finish_reason:
                        await on_tokens(piece.token_ids)
                break
            except BackendError as e:
                # an update in abort mode aborts the engines first and tells the daemons at their next beat: wait
                # for that (bounded); an abort nobody announced is an infrastructure failure, unless the engine is
                # paused and stamps its tokens: another job's update of a shared backend, continued once it resumes
                theirs = await self._theirs(e)
                aborting = self.mode == "abort" or stream.fenced  # an update's abort: this job's, or its keep fence's
                if aborting and isinstance(e, Preempted) and not theirs:
                    await self.gate.wait_paused(UPDATE_NOTICE_SECONDS)
                if not (theirs or self.gate.paused and (isinstance(e, Preempted) or aborting)):
                    raise
                partial = getattr(e, "partial", None)
                if partial is not None:
                    if partial.weight_spans is not None:
                        stamps[-1] = (stamps[-1][0], partial.weight_spans)
                    ids += partial.token_ids
                    logprobs += partial.logprobs
                    stream.got(len(partial.token_ids))
                    if on_tokens is not None and partial.token_ids:
                        await on_tokens(partial.token_ids)
                if not theirs:
                    stream.parked = True
                    self.gate.moved()
                    await self.gate.wait_open()
                    stream.parked = stream.fenced = False
                settle(stream, len(ids))
                stream.runs.append((self.gate.version_of(self.url), 0))
                part += 1
            finally:
                self.in_flight.discard(rid)
        return Generation(ids, logprobs, finish or "length", list(prompt_ids), cached, stop_reason,
                          first_token_seconds=None if first is None else round(first, 6),
                          weight_spans=joined(stamps, len(ids)))

    async def _whole(self, prompt_ids: list[int], sampling: SamplingParams,
                     request_id: str) -> AsyncIterator[Generation]:
        """One plain request to an engine that stamps, as the one piece of a stream (its answer carries the stamps)."""
        yield await self.inner.generate(prompt_ids, sampling, request_id, stamped=True)

    async def _theirs(self, e: BackendError) -> bool:
        """After the engine aborted this call: True when another job's update did it (a shared backend): the gate
        stays open while the engine, which stamps its tokens, was paused; returns once the engine runs again (the
        call then continues, its tokens tagged by the stamps). False at once when the engine does not stamp or was
        not paused, and as soon as this job's gate holds (its own update)."""
        if not (isinstance(e, Preempted) and self.stamped() and not self.gate.paused and await self.inner.paused()):
            return False
        for _ in range(int(120 / 0.02)):  # bounded: an update that takes longer fails the call, as before
            await self.gate.wait_paused(0.02)  # at once when this job's own update comes, else the engine again
            if self.gate.paused:
                return False
            if not await self.inner.paused():
                return True
        return False

    async def abort(self, request_id: str) -> None:
        await self.inner.abort(request_id)

    def __getattr__(self, name: str) -> Any:  # model, max_model_len, ... of the shared backend
        if name == "stream":  # a stream of the backend's own would bypass the gate: `generate(on_tokens=…)` streams
            raise AttributeError(name)
        return getattr(self.inner, name)
