"""What the Slurm executor submits: the sbatch command line and the batch script, as pure strings.

Called by `executor.py` when it submits an allocation; `cli.py` runs the result. No I/O here, so
tests compare both against golden text (tests/controller/executors/slurm/test_slurm_script.py).
"""
from __future__ import annotations

import re
import shlex
from pathlib import Path

from rolloutd.crds.executor import SlurmSpec

from ..base import daemon_argv
from ..logs import log_stem

SCRIPT = """#!/bin/bash
# rolloutd node daemons for RolloutJob "{job}" (uid {uid}), written by the controller's slurm executor.
# One daemon per allocated node, started again if it crashes. The controller URL and the join token come in through the
# environment (sbatch --export=ALL), never on a command line. --label puts each node's index before its lines.
set -e
{setup}
exec srun --ntasks-per-node=1 --kill-on-bad-exit=0 --label {daemon}
"""
RESTARTS = 5  # a daemon that crashes is started again on its node (agents/daemon/supervise.py), this often per 10 min


def allocation_tag(job: str, uid: str) -> str:
    """The Slurm comment that marks an allocation as a job's own (adoption reads it back)."""
    return f"rolloutd uid={uid} job={job}"


def parse_tag(comment: str) -> dict[str, str]:
    """`allocation_tag` read back: {"uid": …, "job": …}; {} for any other comment."""
    if not comment.startswith("rolloutd "):
        return {}
    return dict(kv.split("=", 1) for kv in comment.split()[1:] if "=" in kv)


def batch_script(job: str, uid: str, setup: list[str], python: str, restarts: int = RESTARTS) -> str:
    """The script sbatch reads on stdin: `setup` lines, then one supervised daemon per node."""
    return SCRIPT.format(job=job, uid=uid, setup="\n".join(setup),
                         daemon=shlex.join(daemon_argv(python, "--restarts", str(restarts))))


def sbatch_argv(job: str, uid: str, count: int, spec: SlurmSpec, *, data_dir: Path, log_dir: Path,
                grace: float) -> list[str]:
    """`sbatch` for one allocation of `count` nodes. With a time limit long enough, Slurm sends SIGTERM
    `grace` + 30 s before the end, so the daemons drain before the hard kill."""
    log_name = log_stem(job)  # a job key outside `default` is "namespace/name"
    argv = ["sbatch", "--parsable", f"--job-name=rolloutd-{job}", f"--comment={allocation_tag(job, uid)}",
            f"--nodes={count}", "--ntasks-per-node=1", "--export=ALL", f"--chdir={data_dir}",
            f"--output={log_dir / f'slurm-{log_name}-%j.out'}"]
    for flag, value in (("partition", spec.partition), ("time", spec.time_limit), ("account", spec.account),
                        ("qos", spec.qos), ("constraint", spec.constraint)):
        if value:
            argv.append(f"--{flag}={value}")
    limit = slurm_minutes(spec.time_limit) if spec.time_limit else None
    if limit is not None and limit * 60 >= 4 * (grace + 30):
        argv.append(f"--signal=TERM@{int(grace) + 30}")
    return argv + list(spec.extra_args)


def slurm_minutes(limit: str) -> float | None:
    """A Slurm time limit in minutes ('30', '1:30:00', '2-12', '2-12:00:00'); None for unlimited/unknown."""
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", limit.strip())
    if not m:
        return None
    days, a, b, c = (int(x) if x else None for x in m.groups())
    if days is not None:  # D-HH[:MM[:SS]]
        return days * 1440 + a * 60 + (b or 0) + (c or 0) / 60
    if c is not None:  # HH:MM:SS
        return a * 60 + b + c / 60
    if b is not None:  # MM:SS
        return a + b / 60
    return float(a)  # MM
