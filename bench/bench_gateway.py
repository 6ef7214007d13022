"""Harness gateway overhead (agents/gateway.py): a chat call through the gateway vs the same call
straight to the backend, side by side.

Where it sits: `python -m bench gateway` through `run(quick)`, or ``python -m bench.bench_gateway``.
The backend is the instant stub (stub_backend.py, a subprocess), so only our path is timed:
ours = client → Unix socket → gateway (chat template, tokenize, record) → VLLMBackend → stub → back;
baseline = the client's own `/v1/completions` call with the token ids straight to the stub (what a
harness pays talking to vLLM directly); and the same chat call through the relay a sandbox runs
(gateway.RELAY: TCP loopback → the socket, here a host process), which is what a harness pays. Calls
alternate one by one; each has a new user message. Target: overhead p50 ≤ 2 ms.
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
    from rolloutd.agents.gateway import RELAY, Gateway
    from rolloutd.agents.llm import SamplingParams, VLLMBackend
    from rolloutd.agents.model_dirs import prepare_model
    from rolloutd.agents.tokenizer import ChatTokenizer

    tokenizer = str(prepare_model("tiny"))
    tok = ChatTokenizer(tokenizer)
    port, relay_port = _port(), _port()
    stub = subprocess.Popen([sys.executable, "-m", "bench.stub_backend", "--port", str(port), "--tokenizer",
                             tokenizer], cwd=REPO, start_new_session=True)
    n = 50 if quick else 400
    try:
        _wait_http(f"http://127.0.0.1:{port}/health")

        async def measure():
            times: dict[str, list[float]] = {"socket": [], "relay": [], "direct": []}
            async with VLLMBackend(f"http://127.0.0.1:{port}") as llm:
                gateway = Gateway(llm, tok, SamplingParams(max_tokens=16, seed=1))
                with tempfile.TemporaryDirectory() as tmp:
                    sock = Path(tmp) / "gw.sock"
                    await gateway.start(sock)
                    relay = subprocess.Popen([sys.executable, "-I", "-c", RELAY, str(sock), str(relay_port)],
                                             stdout=subprocess.PIPE, text=True)
                    try:
                        assert relay.stdout.readline().startswith("relay ready")
                        async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=str(sock))) as gw, \
                                httpx.AsyncClient() as plain:
                            for i in range(n + 20):
                                # a new user message each call, as in a conversation: nothing is answered from a cache
                                messages = [*MESSAGES[:-1], {**MESSAGES[-1], "content": f"{MESSAGES[-1]['content']} #{i}"}]
                                ids = tok.encode_chat(messages)
                                chat = {"model": "policy", "messages": messages, "max_tokens": 16}
                                t0 = time.perf_counter()
                                r = await gw.post("http://gateway/v1/chat/completions", json=chat)
                                t1 = time.perf_counter()
                                s = await plain.post(f"http://127.0.0.1:{relay_port}/v1/chat/completions", json=chat)
                                t2 = time.perf_counter()
                                q = await plain.post(f"http://127.0.0.1:{port}/v1/completions",
                                                     json={"model": "stub", "prompt": ids, "max_tokens": 16,
                                                           "logprobs": 0, "return_token_ids": True})
                                t3 = time.perf_counter()
                                assert r.status_code == s.status_code == q.status_code == 200
                                if i >= 20:  # warm-up: connections, caches
                                    times["socket"].append(t1 - t0)
                                    times["relay"].append(t2 - t1)
                                    times["direct"].append(t3 - t2)
                    finally:
                        relay.kill()
                        relay.wait()
                        await gateway.stop()
            return times

        times = asyncio.run(measure())
    finally:
        stub.terminate()
        stub.wait(10)
    p50 = {k: statistics.median(v) * 1000 for k, v in times.items()}
    p95 = {k: sorted(v)[int(0.95 * (len(v) - 1))] * 1000 for k, v in times.items()}
    rows = []
    for key, what in (("socket", "the gateway's socket"), ("relay", "the in-sandbox relay + the gateway")):
        over = p50[key] - p50["direct"]
        rows += [{"benchmark": f"chat call through {what} vs straight to the backend (instant stub)",
                  "ours": f"{p50[key]:.2f} ms (p95 {p95[key]:.2f})",
                  "baseline": f"{p50['direct']:.2f} ms (p95 {p95['direct']:.2f})", "ratio": p50[key] / p50["direct"],
                  "target": "overhead p50 ≤ 2 ms", "met": over <= 2.0},
                 {"benchmark": f"overhead per call through {what} (p50 difference)", "ours": f"{over:.2f} ms",
                  "baseline": "-", "ratio": None, "target": "≤ 2 ms", "met": over <= 2.0}]
    return rows


if __name__ == "__main__":
    from bench.__main__ import render

    print(render(run(quick="--quick" in sys.argv)))
