"""The node's queued prefill on each backend: `PrefillGate` lets one long prompt of the node wait for its prefill at a
backend at a time; the node's other long prompts wait here until that one has its first token (or has ended).

`llmgate.TrackedLLM` passes every call through `PrefillGate.slot` before the work and token shares; the call's stream
calls the yielded `prefilled` at its first token. Why: an engine queues first come, first served and, without chunked
prefill, prefills a long prompt in a step of its own that every running request waits for. A job alone on a shared
backend is not held (work-conserving), so before this gate its episodes' long prompts filled the engine's queue, and a
job arriving later waited behind all of them: 8 whole-context prompts of ~40 s each on a 2-core box, beyond what
the work share can reach (it holds calls not yet sent). With the gate a latecomer waits behind one long prefill per
node of the other job, and from then on the work share holds that job's next calls. A prompt is long past
`LONG_PROMPT_TOKENS`: beyond vLLM's usual step budget with chunked prefill (`max_num_batched_tokens` 8192), so two
such prefills cannot share one step there, and serialising them should cost a job alone little (expected, not yet
measured on a quiet box: bench/results/RESULTS-fairshare.md). Short calls never wait here, and decoding never holds
the gate.
"""
from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict
from typing import AsyncIterator, Callable

LONG_PROMPT_TOKENS = 8192  # prompt tokens past which a call's prefill is long (one at a time per node and backend)


class PrefillGate:
    def __init__(self, long_prompt: int = LONG_PROMPT_TOKENS) -> None:
        self.long_prompt = long_prompt
        self._turn: dict[str | None, asyncio.Lock] = defaultdict(asyncio.Lock)  # url → the one long prefill's turn
        self.waiting = 0  # long calls held here now
        self.held = 0  # long calls that were held, ever

    @classmethod
    def off(cls) -> "PrefillGate":
        """A gate that holds no call (a test or bench of the other shares alone, or of the behaviour without it)."""
        return cls(long_prompt=10**12)

    def holds(self, prompt: int) -> bool:
        """Whether a call of `prompt` tokens takes a turn here (its prefill is long)."""
        return prompt > self.long_prompt

    @contextlib.asynccontextmanager
    async def slot(self, url: str | None, prompt: int) -> AsyncIterator[Callable[[], None]]:
        """Hold a long prompt until no other long prompt of the node awaits its prefill at `url`; yields `prefilled`,
        to call at the call's first token (the turn passes on then, or when the call ends, however it ends)."""
        if url is None or not self.holds(prompt):
            yield lambda: None
            return
        turn = self._turn[url]
        if turn.locked():
            self.waiting += 1
            self.held += 1
            try:
                await turn.acquire()
            finally:
                self.waiting -= 1
        else:
            await turn.acquire()
        passed = False

        def prefilled() -> None:
            nonlocal passed
            if not passed:
                passed = True
                turn.release()

        try:
            yield prefilled
        finally:
            prefilled()
