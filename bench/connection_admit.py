"""The connection budget's cost per accepted connection at a full budget (`python -m bench.connection_admit [REV]`):
this tree's `controller/http/connection_budget.py` beside revision REV's (default 5fabd7b, whose room-making copied
every counted connection at each accept). 15 000 counted (the default budget at 20 000 descriptors), 200 of them
serving long streams, then 2000 accepts; stand-in sockets (the budget only asks their descriptor and shuts them)."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODULE = "controller/http/connection_budget.py"


class Conn:
    count = 0

    def __init__(self) -> None:
        Conn.count += 1
        self.fd = Conn.count

    def fileno(self) -> int:
        return self.fd

    def shutdown(self, how: int) -> None:
        pass


def per_accept(path: Path, label: str, counted: int = 15000, streams: int = 200, accepts: int = 2000) -> float:
    spec = importlib.util.spec_from_file_location(f"budget_{label}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    budget = module.ConnectionBudget(counted)
    for i in range(counted):
        conn = Conn()
        budget.admit(conn)
        if i < streams:
            budget.serving(conn.fileno())
    t = time.perf_counter()
    for _ in range(accepts):
        budget.admit(Conn())
    return (time.perf_counter() - t) / accepts


def main(rev: str = "5fabd7b") -> None:
    root = Path(__file__).resolve().parents[1]
    old = Path(tempfile.mkdtemp()) / "old_budget.py"
    old.write_text(subprocess.run(["git", "-C", str(root), "show", f"{rev}:{MODULE}"], capture_output=True,
                                  text=True, check=True).stdout)
    for label, path in ((rev, old), ("this tree", root / MODULE)):
        print(f"{label}: {per_accept(path, label.replace(' ', '_')) * 1e6:.1f} µs per accept at a full budget of 15000")


if __name__ == "__main__":
    main(*sys.argv[1:])
