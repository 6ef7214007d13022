"""rolloutd benchmarks: each `bench_*.py` module measures ours against a baseline side by side in one run.

The stand-ins they drive (simulated nodes, a one-machine Slurm, the no-op task kind) are tests/support/sim, the
package `support.sim`, kept out of the wheel: tests/ goes on sys.path here for that package alone
(tests/test_structure.py refuses any other import of tests/ from bench/)."""
import sys
from pathlib import Path

_TESTS = str(Path(__file__).resolve().parents[1] / "tests")
if _TESTS not in sys.path:
    sys.path.append(_TESTS)  # appended: a module of bench/ or of the product never gives way to one of tests/
