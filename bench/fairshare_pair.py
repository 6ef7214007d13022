"""The prefill gate on and off on one engine, one after the other (`python -m bench.fairshare_pair`): team-b's
episodes/s after team-a's 65 000-token episodes filled the backend (`fairshare_late.late_row`), one JSON row each.
Next step: several alternating pairs over a longer window (bench/results/RESULTS-fairshare.md)."""
from __future__ import annotations

import json
import time

from bench import fairshare_late as f
from rolloutd.agents.engine.server import EngineServer


def main(window: float = 120.0) -> None:
    engine = EngineServer("tiny", dtype="float32", max_model_len=65536)
    engine.start()
    try:
        for gated in (True, False):
            t = time.time()
            row = f.late_row(engine.url, 65000, window, gated)
            print(json.dumps({**row, "took_s": round(time.time() - t)}), flush=True)
    finally:
        engine.stop()


if __name__ == "__main__":
    main()
