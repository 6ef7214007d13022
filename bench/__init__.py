"""rolloutd benchmarks: each `bench_*.py` module measures ours against a baseline side by side in one run."""
