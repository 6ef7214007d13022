"""A batch answer (`GET …/batches/{k}`) written the way the trainer routes write it now (`typed`, in
controller/http/trainer.py: FastAPI checks it against `crds.trainer_api.Batch` and writes the JSON in pydantic's core)
side by side with the way they wrote it before (a plain dict: FastAPI's generic `jsonable_encoder`, in Python), in
one run, through the same ASGI app: the seconds per answer and the longest the event loop went without a turn while
it was written (what every other request, node calls included, waited). Results: bench/results/RESULTS-answers.md.
"""
from __future__ import annotations

import asyncio
import random
import statistics
import time

import httpx
from fastapi import FastAPI

from rolloutd.controller.http.trainer import typed
from rolloutd.crds.trainer_api import Batch

TARGET = 10.0  # the typed answer at least this many times faster, and the loop's stall as much shorter


def batch(groups: int, samples: int, tokens: int) -> dict:
    """A complete batch of `groups` × `samples` trajectories of `tokens` generated tokens each."""
    rng = random.Random(0)

    def trajectory(i: int) -> dict:
        return {"seq": i, "job": "bench", "prompt": i // samples, "sample": i % samples,
                "tokenIds": list(range(tokens)),
                "logprobs": [-rng.random() for _ in range(tokens)], "lossMask": [1] * tokens, "reward": 1.0,
                "versionSpans": [{"version": 1, "start": 0, "end": tokens}]}
    return {"batch": 1, "state": "complete", "target": groups, "counted": groups, "prompts": None,
            "openedGroups": groups, "cancelledRollouts": 0, "neverStarted": 0, "savedTokensEstimate": 0,
            "secondsToFill": 1.0, "policyVersions": ["1"],
            "groups": [{"group": g, "prompt": g, "state": "counted", "rewards": [0.0, 1.0] * (samples // 2),
                        "samples": [trajectory(g * samples + s) for s in range(samples)]} for g in range(groups)]}


async def measure(answer: dict, repeats: int) -> dict[str, dict[str, float]]:
    app = FastAPI()

    @app.get("/typed", **typed(Batch))
    async def typed_route():
        return answer

    @app.get("/plain")
    async def plain_route():
        return answer

    out: dict[str, dict[str, float]] = {}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://bench") as client:
        for path in ("/typed", "/plain"):
            seconds, stalls = [], []
            for _ in range(repeats):
                stall, stop = [0.0], asyncio.Event()

                async def ticker() -> None:
                    last = time.perf_counter()
                    while not stop.is_set():
                        await asyncio.sleep(0.001)
                        now = time.perf_counter()
                        stall[0], last = max(stall[0], now - last), now
                tick = asyncio.ensure_future(ticker())
                await asyncio.sleep(0.01)
                t0 = time.perf_counter()
                r = await client.get(path)
                seconds.append(time.perf_counter() - t0)
                stop.set()
                await tick
                stalls.append(stall[0])
                assert r.status_code == 200 and len(r.json()["groups"]) == len(answer["groups"]), r.status_code
            out[path] = {"seconds": statistics.median(seconds), "stall": statistics.median(stalls),
                         "bytes": len(r.content)}
    return out


def run(quick: bool = False) -> list[dict]:
    groups, samples, tokens = (16, 8, 1024) if quick else (64, 16, 4096)
    got = asyncio.run(measure(batch(groups, samples, tokens), 1 if quick else 3))
    t, p = got["/typed"], got["/plain"]
    shape = f"{groups}×{samples} trajectories of {tokens} tokens, {t['bytes'] / 1e6:.0f} MB"
    print(f"answers: {shape}: typed {t['seconds']:.2f} s (loop stall {t['stall']:.2f} s), "
          f"plain {p['seconds']:.2f} s (stall {p['stall']:.2f} s)")
    speed, stall = p["seconds"] / t["seconds"], p["stall"] / max(t["stall"], 1e-3)
    return [{"benchmark": f"batch answer, {shape}: seconds", "ours": f"{t['seconds']:.2f} s",
             "baseline": f"{p['seconds']:.2f} s (generic encoder)", "ratio": speed, "target": f"≥{TARGET:.0f}×",
             "met": speed >= TARGET},
            {"benchmark": f"batch answer, {shape}: longest loop stall", "ours": f"{t['stall']:.2f} s",
             "baseline": f"{p['stall']:.2f} s (generic encoder)", "ratio": stall, "target": f"≥{TARGET:.0f}×",
             "met": stall >= TARGET}]
