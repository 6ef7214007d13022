"""The baseline of `bench engine_busy`: a job's conversations replayed straight at the engine (no service in
between) and the arithmetic both sides share (the engine's busy window, C slots' time split by what fills them).

`replay_plan` rebuilds each turn's prompt ids and length from stored trajectories, `replay` sends them with the
body `rolloutd.agents.vllm_backend.VLLMBackend` sends; `busy_stats` and `slot_budget` read the samples and timings.
Next step: an A-B-A order (service, replay, service) to cancel a shared machine's drift.
"""
from __future__ import annotations

import asyncio
import statistics

import httpx


def replay_plan(trajectories: list[dict]) -> list[list[dict]]:
    """Per conversation, its turns in order: the prompt ids the engine was sent (everything before the turn's
    generated ids: the first prompt, earlier turns, the tool outputs) and the number of ids it generated."""
    plan = []
    for t in sorted(trajectories, key=lambda t: (t["prompt"], t["sample"])):
        ids, turns = t["tokenIds"], []
        for turn in t["turns"]:
            start, end = turn["generatedStart"], turn["generatedEnd"]
            turns.append({"prompt_ids": ids[:start], "max_tokens": end - start, "seed": len(turns)})
        plan.append(turns)
    return plan


async def replay(url: str, model: str, plan: list[list[dict]], concurrency: int) -> int:
    """Send every conversation of `plan` with `concurrency` workers, turn after turn; returns the tokens generated."""
    queue: asyncio.Queue = asyncio.Queue()
    for i, conversation in enumerate(plan):
        queue.put_nowait((i, conversation))
    generated = 0
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        async def worker() -> None:
            nonlocal generated
            while not queue.empty():
                i, conversation = queue.get_nowait()
                for k, turn in enumerate(conversation):
                    n = turn["max_tokens"]
                    body = {"model": model, "prompt": turn["prompt_ids"], "max_tokens": n, "min_tokens": n,
                            "ignore_eos": True, "temperature": 1.0, "top_p": 1.0, "seed": turn["seed"],
                            "logprobs": 0, "return_token_ids": True, "return_tokens_as_token_ids": True,
                            "skip_special_tokens": False, "request_id": f"replay-{i}-t{k}"}
                    resp = await client.post("/v1/completions", json=body)
                    resp.raise_for_status()
                    generated += len(resp.json()["choices"][0]["token_ids"])

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return generated


def busy_stats(samples: list[tuple[float, float]]) -> dict:
    """Window (first to last sample with a request running), busy fraction and mean running inside it."""
    busy = [i for i, (_, running) in enumerate(samples) if running > 0]
    if not busy:
        return {"start": 0.0, "end": 0.0, "window": 0.0, "busy": 0.0, "mean_running": 0.0}
    inside = samples[busy[0]:busy[-1] + 1]
    return {"start": inside[0][0], "end": inside[-1][0], "window": inside[-1][0] - inside[0][0],
            "busy": sum(r > 0 for _, r in inside) / len(inside),
            "mean_running": statistics.mean(r for _, r in inside)}


def slot_budget(trajectories: list[dict], concurrency: int, start: float, end: float, step: float = 0.01) -> dict:
    """Split `concurrency` × [start, end] into slot-seconds: generating (a turn in flight), between turns (the tool
    call and the turn's bookkeeping), in RUN outside any turn, and no rollout in RUN (the rest)."""
    spans = []
    for t in trajectories:
        run = t["timings"]["stamps"]["run"]
        stamps = t["metrics"]["turn_stamps"]
        spans.append((run, run + t["timings"]["run"], stamps))
    out = {"generating": 0.0, "between_turns": 0.0, "run_outside_turns": 0.0, "no_rollout_in_run": 0.0}
    now = start
    while now < end:
        gen = between = in_run = 0
        for r0, r1, stamps in spans:
            if not r0 <= now < r1:
                continue
            in_run += 1
            if any(sent <= now < back for sent, back, _ in stamps):
                gen += 1
            elif any(stamps[k][1] <= now < stamps[k + 1][0] for k in range(len(stamps) - 1)):
                between += 1
        out["generating"] += gen * step
        out["between_turns"] += between * step
        out["run_outside_turns"] += (in_run - gen - between) * step
        out["no_rollout_in_run"] += max(0, concurrency - in_run) * step
        now += step
    return out


def refill_delays(trajectories: list[dict], concurrency: int) -> list[float]:
    """How long each RUN slot stayed empty after a rollout left it, while more rollouts were to come: the k-th RUN
    end is refilled by the (C + k)-th RUN start (both sorted); the last ones have nothing left to refill them."""
    starts = sorted(t["timings"]["stamps"]["run"] for t in trajectories)
    ends = sorted(t["timings"]["stamps"]["run"] + t["timings"]["run"] for t in trajectories)
    return [max(0.0, start - end) for end, start in zip(ends, starts[concurrency:])]
