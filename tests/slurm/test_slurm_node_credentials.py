"""The Slurm executor hands a job's daemons that job's own node credential (issue 24): a real allocation on
the mini cluster, its daemons registering with the credential the executor minted at sbatch (there is no
controller-wide join token), Slurm's job record never showing it, and the job's release revoking it.
The LLM is a stub (tests/support/stub_llm.py): no engine is started."""
from __future__ import annotations

import json
from types import SimpleNamespace

import httpx

from support.slurm_cluster import SlurmCluster, slurm_job_doc
from support.stub_llm import StubLLM
from support.waiting import wait_until

from rolloutd.agents.engine.model_dirs import model_dir
from rolloutd.crds.node import NODE_PROTOCOL

NODES = "/apis/rolloutd.io/v1alpha1/nodes"


def _credential(scluster: SlurmCluster, key: str) -> str | None:
    try:
        return json.loads((scluster.data_dir / "node-credentials.json").read_text())[key]["credential"]
    except (OSError, ValueError, KeyError):
        return None


def test_a_slurm_jobs_daemons_use_its_own_credential_and_release_revokes_it(scluster: SlurmCluster):
    stub = StubLLM()
    try:
        engine = SimpleNamespace(model_dir=model_dir("tiny"), url=stub.url)
        scluster.apply(slurm_job_doc("s-creds", engine, nodes=1, limit=2, samples=2, tools=("submit",), max_turns=1))
        credential = wait_until(lambda: _credential(scluster, "s-creds"), 60, "the job's credential minted at sbatch")
        uid = scluster.uid("s-creds")
        alloc = wait_until(lambda: scluster.allocations(uid), 60, "the allocation")[0]
        for argv in (["scontrol", "show", "job", "-dd", alloc["id"]], ["squeue", "--json"]):
            out = scluster.slurm.run(*argv).stdout
            assert alloc["id"] in out and credential not in out, argv
        final = scluster.wait_done("s-creds", timeout=240)
        assert final["status"]["counts"]["succeeded"] == 4
        assert {n["slurm_job_id"] for n in scluster.nodes("s-creds")} == {alloc["id"]}  # Slurm's daemon did it
        assert not (scluster.data_dir / "join-token").exists()
        wait_until(lambda: _credential(scluster, "s-creds") is None, 60, "the credential revoked on release")
        # the daemons took the revocation for the job's end: they left by themselves, the allocation COMPLETED
        scluster.wait_no_allocations(uid, timeout=60)
        assert scluster.allocations(uid)[0]["state"] == "COMPLETED", scluster.allocations(uid)
        r = httpx.post(scluster.url + f"{NODES}/register?features=node-token", timeout=30,
                       headers={"Authorization": f"Bearer {credential}"},
                       json={"job": "s-creds", "protocol": NODE_PROTOCOL, "name": "late", "host": "h", "pid": 1})
        assert r.status_code == 401, r.text
    finally:
        stub.close()
