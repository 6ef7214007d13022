"""`rolloutctl logs` on the Slurm executor: the allocation's output file (where sbatch writes it, in the
controller's data dir), served by the controller; srun's --label puts each node's index before its lines, so
`--node K` is that node's daemon. A real allocation of two nodes on the mini cluster; the LLM is a stub
(tests/support/stub_llm.py): no engine is started."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from types import SimpleNamespace

from support.slurm_cluster import SlurmCluster, slurm_job_doc
from support.stub_llm import StubLLM
from support.waiting import wait_until

from rolloutd.agents.engine.model_dirs import model_dir


def _logs(scluster: SlurmCluster, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "ROLLOUTD_SERVER": scluster.url, "ROLLOUTD_TOKEN": scluster.token,
           "ROLLOUTD_CONFIG": str(scluster.root / "no-config.yaml")}
    return subprocess.run([sys.executable, "-m", "rolloutd.controller.ctl", "logs", "s-logs", *args],
                          capture_output=True, text=True, env=env, timeout=60)


def test_logs_of_a_slurm_job_come_from_its_allocation_output_node_by_node(scluster: SlurmCluster):
    stub = StubLLM()
    try:
        engine = SimpleNamespace(model_dir=model_dir("tiny"), url=stub.url)
        scluster.apply(slurm_job_doc("s-logs", engine, nodes=2, limit=2, samples=2, tools=("submit",), max_turns=1))

        def both_registered() -> bool:
            out = _logs(scluster).stdout
            return len(set(re.findall(r"^\s*(\d+): .*registered with", out, re.M))) == 2
        wait_until(both_registered, 120, "both daemons' registration in the allocation's output", every=0.5)
        one = _logs(scluster, "--node", "1", "--tail", "1000").stdout.splitlines()
        assert one and all(re.match(r"\s*1: ", line) for line in one), one
        assert any("registered with" in line for line in one)
        scluster.wait_done("s-logs", timeout=240)
    finally:
        stub.close()
