"""Harness gateway overhead (agents/gateway.py): a chat call through the gateway vs the same call
straight to the backend, side by side.

Where it sits: `python -m bench gateway` through `run(quick)`, or ``python -m bench.bench_gateway``.
The backend is the instant stub (stub_backend.py, a subprocess), so only our path is timed:
ours = client → Unix socket → gateway (chat template, tokenize, record) → VLLMBackend → stub → back;
baseline = the client's own `/v1/completions` call with the token ids straight to the stub (what a
harness pays talking to vLLM directly). Calls alternate one by one. Target: overhead p50 ≤ 2 ms.
The in-sandbox relay (TCP loopback → the socket) is one more local hop, not timed here.
"""
from __future__ import annotations

import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.bench_pipeline import REPO, _port, _wait_http

MESSAGES = [{"role": "system", "content": "You are a terminal agent."},
            {"role": "user", "content": "Count the distinct words in words.txt."}]


def run(quick: bool = False) -> list[dict]:
    from rolloutd.agents.gateway import Gateway
    from rolloutd.agents.llm import SamplingParams, VLLMBackend
    from rolloutd.agents.model_dirs import prepare_model
    from rolloutd.agents.tokenizer import ChatTokenizer

    tokenizer = str(prepare_model("tiny"))
    tok = ChatTokenizer(tokenizer)
    port = _port()
    stub = subprocess.Popen([sys.executable, "-m", "bench.stub_backend", "--port", str(port), "--tokenizer",
                             tokenizer], cwd=REPO, start_new_session=True)
    n = 50 if quick else 400
    try:
        _wait_http(f"http://127.0.0.1:{port}/health")

        async def measure():
            ours, direct = [], []
            async with VLLMBackend(f"http://127.0.0.1:{port}") as llm:
                gateway = Gateway(llm, tok, SamplingParams(max_tokens=16, seed=1))
                with tempfile.TemporaryDirectory() as tmp:
                    sock = Path(tmp) / "gw.sock"
                    await gateway.start(sock)
                    try:
                        async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=str(sock))) as gw, \
                                httpx.AsyncClient() as plain:
                            ids = tok.encode_chat(MESSAGES)
                            for i in range(n + 20):
                                t0 = time.perf_counter()
                                r = await gw.post("http://gateway/v1/chat/completions",
                                                  json={"model": "policy", "messages": MESSAGES, "max_tokens": 16})
                                t1 = time.perf_counter()
                                q = await plain.post(f"http://127.0.0.1:{port}/v1/completions",
                                                     json={"model": "stub", "prompt": ids, "max_tokens": 16,
                                                           "logprobs": 0, "return_token_ids": True})
                                t2 = time.perf_counter()
                                assert r.status_code == 200 and q.status_code == 200
                                if i >= 20:  # warm-up: connections, caches
                                    ours.append(t1 - t0)
                                    direct.append(t2 - t1)
                    finally:
                        await gateway.stop()
            return ours, direct

        ours, direct = asyncio.run(measure())
    finally:
        stub.terminate()
        stub.wait(10)
    o50, d50 = statistics.median(ours) * 1000, statistics.median(direct) * 1000
    p95 = lambda xs: sorted(xs)[int(0.95 * (len(xs) - 1))] * 1000  # noqa: E731
    return [{"benchmark": "chat call through the gateway vs straight to the backend (instant stub)",
             "ours": f"{o50:.2f} ms (p95 {p95(ours):.2f})", "baseline": f"{d50:.2f} ms (p95 {p95(direct):.2f})",
             "ratio": o50 / d50, "target": "overhead p50 ≤ 2 ms", "met": o50 - d50 <= 2.0},
            {"benchmark": "gateway overhead per call (p50 difference)", "ours": f"{o50 - d50:.2f} ms",
             "baseline": "-", "ratio": None, "target": "≤ 2 ms", "met": o50 - d50 <= 2.0}]


if __name__ == "__main__":
    from bench.__main__ import render

    print(render(run(quick="--quick" in sys.argv)))
