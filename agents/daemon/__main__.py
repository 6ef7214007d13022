"""`python -m rolloutd.agents.daemon`: a node daemon's own entry point, the one every executor starts.

Where it sits: the local executor (controller/executors/local.py), the Slurm batch script
(controller/executors/slurm/script.py) and the supervisor of `--restarts` (agents/cli.py → daemon/supervise.py)
run this module, so a node starts without the controller's `rolloutd` command and its entry-point lookup of
sub-commands. The options are `rolloutd node`'s (agents/cli.py `node`, which stays for daemons started by hand);
the next step is daemon/options.py (the environment read once) and daemon/daemon.py (`run_node`).
"""
from __future__ import annotations

import typer

from rolloutd.agents.cli import node


def main() -> None:
    typer.run(node)


if __name__ == "__main__":
    main()
