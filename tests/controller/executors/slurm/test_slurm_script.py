"""What the Slurm executor submits, as golden text (pure functions, no Slurm needed): the batch script
and the sbatch command line, including when Slurm is asked to send SIGTERM before the time limit."""
from __future__ import annotations

from pathlib import Path

from rolloutd.controller.executors.slurm.script import allocation_tag, batch_script, parse_tag, sbatch_argv
from rolloutd.crds.executor import SlurmSpec

GOLDEN_SCRIPT = """#!/bin/bash
# rolloutd node daemons for RolloutJob "math" (uid u-1), written by the controller's slurm executor.
# One daemon per allocated node, started again if it crashes. The controller URL and the join token come in through the
# environment (sbatch --export=ALL), never on a command line. --label puts each node's index before its lines.
set -e
module load foo
export X=1
exec srun --ntasks-per-node=1 --kill-on-bad-exit=0 --label '/opt/py env/bin/python' -m rolloutd.agents.daemon --restarts 5
"""


def test_the_batch_script_runs_the_setup_then_one_supervised_daemon_per_node():
    assert batch_script("math", "u-1", ["module load foo", "export X=1"], "/opt/py env/bin/python") == GOLDEN_SCRIPT


def test_the_sbatch_command_line_carries_every_option_and_the_tag():
    spec = SlurmSpec(partition="debug", time_limit="8:00:00", account="acct", qos="q", constraint="c",
                     extra_args=["--exclusive"])
    argv = sbatch_argv("math", "u-1", 3, spec, data_dir=Path("/d"), log_dir=Path("/d/logs"), grace=45.0)
    assert argv == ["sbatch", "--parsable", "--job-name=rolloutd-math", "--comment=rolloutd uid=u-1 job=math",
                    "--nodes=3", "--ntasks-per-node=1", "--export=ALL", "--chdir=/d",
                    "--output=/d/logs/slurm-math-%j.out", "--partition=debug", "--time=8:00:00", "--account=acct",
                    "--qos=q", "--constraint=c", "--signal=TERM@75", "--exclusive"]


def test_sigterm_before_the_time_limit_only_when_the_limit_leaves_room_to_drain():
    def signal(limit: str | None) -> list[str]:
        argv = sbatch_argv("j", "u", 1, SlurmSpec(time_limit=limit), data_dir=Path("/d"), log_dir=Path("/l"),
                           grace=45.0)
        return [a for a in argv if a.startswith("--signal")]
    assert signal(None) == [] and signal("4") == []            # 240 s < 4 × (45 + 30)
    assert signal("5") == ["--signal=TERM@75"]                 # 300 s: just enough
    assert signal("1-00:00:00") == ["--signal=TERM@75"]


def test_the_allocation_tag_reads_back():
    assert parse_tag(allocation_tag("math", "u-1")) == {"uid": "u-1", "job": "math"}
    assert parse_tag("someone else's comment") == {}
