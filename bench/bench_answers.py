"""A batch answer (`GET …/batches/{k}`) written the way the trainer routes write it now (`typed`, in
controller/http/trainer.py: FastAPI checks it against `crds.trainer_api.Batch` and writes the JSON in pydantic's core)
side by side with the way they wrote it before (a plain dict: FastAPI's generic `jsonable_encoder`, in Python), in
one run, through the same ASGI app: the seconds per answer and the longest the event loop went without a turn while
it was written (what every other request, node calls included, waited). The same for the web UI's one-trajectory
view (`controller/ui/answers.py`: encoded by json's C encoder in the route's worker thread, against the generic
encoder). Results: bench/results/RESULTS-answers.md.
"""
from __future__ import annotations

import asyncio
import json
import random
import statistics
import time

import httpx
from fastapi import FastAPI

from rolloutd.controller.http.trainer import typed
from rolloutd.crds.trainer_api import Batch

TARGET = 10.0  # the longest loop stall at least this many times shorter than the generic encoder's


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


def view(tokens: int) -> tuple[dict, str]:
    """The UI's view of one trajectory of `tokens` generated tokens (`decode.decode`), and its stored JSON."""
    from rolloutd.controller import decode
    raw = batch(1, 1, tokens)["groups"][0]["samples"][0]
    return {**decode.decode(raw, None), "seq": 0, "waterfall": {"stages": []}}, json.dumps(raw)


def batch_app(answer: dict) -> FastAPI:
    app = FastAPI()

    @app.get("/typed", **typed(Batch))
    async def typed_route():
        return answer

    @app.get("/plain")
    async def plain_route():
        return answer
    return app


def view_app(answer: tuple[dict, str]) -> FastAPI:
    """The trajectory page's route as it answers now (`with_raw`, in a worker thread) and before (the view with
    the stored trajectory parsed under "raw", through the generic encoder)."""
    from rolloutd.controller.ui.answers import json_response, with_raw
    app = FastAPI()
    shown, stored = answer

    @app.get("/typed")
    async def encoded_route():
        return json_response(await asyncio.to_thread(with_raw, shown, 0, stored))

    @app.get("/plain")
    async def plain_route():
        return {**shown, "raw": {"seq": 0, **json.loads(stored)}}
    return app


async def measure(app: FastAPI, repeats: int, key: str = "groups") -> dict[str, dict[str, float]]:
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
                assert r.status_code == 200 and r.json()[key], r.status_code
            out[path] = {"seconds": statistics.median(seconds), "stall": statistics.median(stalls),
                         "bytes": len(r.content)}
    return out


def run(quick: bool = False) -> list[dict]:
    groups, samples, tokens = (16, 8, 1024) if quick else (64, 16, 4096)
    repeats = 1 if quick else 3
    rows = _rows("batch answer", asyncio.run(measure(batch_app(batch(groups, samples, tokens)), repeats)),
                 f"{groups}×{samples} trajectories of {tokens} tokens")
    tokens = 4096 if quick else 65536
    return rows + _rows("UI trajectory view", asyncio.run(measure(view_app(view(tokens)), repeats, "raw")),
                        f"one trajectory of {tokens} tokens")


def _rows(what: str, got: dict, shape: str) -> list[dict]:
    t, p = got["/typed"], got["/plain"]
    shape = f"{shape}, {t['bytes'] / 1e6:.1f} MB"
    print(f"answers: {what}, {shape}: now {t['seconds']:.3f} s (loop stall {t['stall']:.3f} s), "
          f"generic {p['seconds']:.3f} s (stall {p['stall']:.3f} s)")
    speed, stall = p["seconds"] / t["seconds"], p["stall"] / max(t["stall"], 1e-3)
    return [{"benchmark": f"{what}, {shape}: seconds", "ours": f"{t['seconds']:.3f} s",
             "baseline": f"{p['seconds']:.3f} s (generic encoder)", "ratio": speed, "target": "reported",
             "met": None},
            {"benchmark": f"{what}, {shape}: longest loop stall", "ours": f"{t['stall']:.3f} s",
             "baseline": f"{p['stall']:.3f} s (generic encoder)", "ratio": stall, "target": f"≥{TARGET:.0f}×",
             "met": stall >= TARGET}]
