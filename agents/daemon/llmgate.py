"""One rollout's view of the shared backend: `TrackedLLM`, each model call through the job's policy gate, its in-flight
request ids kept for server-side aborts and the policy version of each turn and token recorded.

`pipeline.Pipeline` hands each RUN a `TrackedLLM` over the node's `policygate.PolicyGate` (set by
`heartbeat.Heartbeater`); its generations carry their run-length versions (`Generation.versions`) for the agent
loop's `versionSpans`.
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from .. import spans as node_traces
from ..llm import BackendError, Generation, LLMBackend, Preempted, SamplingParams
from .policygate import PolicyGate, Stream, settle
from .weightstamps import joined, stamped_versions

# abort mode: how long an aborted request waits to hear of the update that aborted it (a beat or two)
UPDATE_NOTICE_SECONDS = 5.0
# drain mode: one call in this many streams, its time to first token measured (a stream costs a chunk per token)
TIMED_EVERY = 64


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
