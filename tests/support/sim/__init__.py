"""Stand-ins for the world around rolloutd, shared by tests/ and bench/: a real Slurm cluster on one machine
(`minicluster.py`), node daemons simulated by the thousand over the real node protocol (`simnodes.py`), LLM
backends that only answer health checks and a task kind that does nothing (`noop.py`, `plugins/`).

The package `support.sim` (tests/ on sys.path): not in the wheel; from a checkout,
`PYTHONPATH=tests .venv/bin/python -m support.sim.minicluster start`. tests/ and bench/ may both import this
package (bench/ nothing else of tests/); it imports neither the rest of support/ nor bench/
(tests/test_structure.py). `module_command` starts one of its modules in a process of its own; `alive` is the
one check of a process's /proc state for all of tests/ (`support.waiting` hands it on). Next step: the
stub LLM backends of tests/ and bench/ could join here as one."""
from __future__ import annotations

import os
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[2]  # the folder that holds `support`, put on a child's PYTHONPATH


def module_command(module: str, *args: str, env: dict[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """`python -m support.sim.<module> ARGS` and the environment that finds it (tests/ first on PYTHONPATH)."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS), env.get("PYTHONPATH", "")) if p)
    return [sys.executable, "-m", f"support.sim.{module}", *args], env


def alive(pid: int) -> bool:
    """Whether `pid` runs: it exists and is neither a zombie nor dead (its /proc state)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")
