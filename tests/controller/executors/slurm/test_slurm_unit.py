"""The slurm executor's logic against a scripted Slurm CLI (no Slurm needed): parsing, refusals,
back-off, adoption without a state file, a Slurm that cannot be queried, where the token goes."""
from __future__ import annotations

import asyncio
import json
from datetime import datetime, timezone
from pathlib import Path

import pytest

from rolloutd.controller.executors.base import ExecutorError
from rolloutd.controller.executors.slurm.cli import expand_hostlist, parse_scontrol, parse_squeue, sanitized_env
from rolloutd.controller.executors.slurm.executor import SlurmExecutor
from rolloutd.controller.executors.slurm.script import slurm_minutes
from rolloutd.controller.access.nodeauth import NodeCredentials
from rolloutd.crds.rolloutjob import RolloutJob


def make_job(name: str = "j", uid: str = "u-1", nodes: int = 2, **slurm) -> RolloutJob:
    return RolloutJob.model_validate({
        "apiVersion": "rolloutd.io/v1alpha1", "kind": "RolloutJob",
        "metadata": {"name": name, "uid": uid, "generation": 1, "resourceVersion": "1"},
        "spec": {"tasks": {"kind": "math", "source": "/x.jsonl"}, "llm": {"tokenizer": "/t"},
                 "executor": {"kind": "slurm", "nodes": nodes, "slurm": slurm}},
    })


class FakeSlurm:
    """Just enough of sbatch/squeue/scontrol/scancel, with scripted failures."""

    def __init__(self) -> None:
        self.jobs: dict[str, dict] = {}
        self.next_id = 100
        self.calls: list[tuple[list[str], dict[str, str], str | None]] = []
        self.sbatch_error: tuple[int, str] | None = None
        self.squeue_error: str | None = None

    async def __call__(self, argv, env, input_):
        self.calls.append((argv, env, input_))
        cmd = argv[0]
        if cmd == "squeue":
            if self.squeue_error:
                return 1, "", self.squeue_error
            return 0, "".join(f"{i}|{j['name']}|{j['state']}|{j['reason']}|{j['nodes']}|{j['nodelist']}|{j['comment']}\n"
                              for i, j in self.jobs.items()), ""
        if cmd == "sbatch":
            if self.sbatch_error:
                return self.sbatch_error[0], "", self.sbatch_error[1]
            jid = str(self.next_id)
            self.next_id += 1
            opts = dict(a[2:].split("=", 1) for a in argv if a.startswith("--") and "=" in a)
            n = int(opts["nodes"])
            self.jobs[jid] = {"name": opts["job-name"], "state": "RUNNING", "reason": "None", "nodes": n,
                              "nodelist": f"n[1-{n}]" if n > 1 else "n1", "comment": opts["comment"]}
            return 0, f"{jid}\n", ""
        if cmd == "scancel":
            for a in argv[1:]:
                if a in self.jobs and not a.startswith("-") and "--signal=TERM" not in argv:
                    self.jobs[a]["state"] = "CANCELLED"
            return 0, "", ""
        if cmd == "scontrol":
            jid = argv[3] if len(argv) > 3 else ""
            j = self.jobs.get(jid)
            if j is None:
                return 1, "", "slurm_load_jobs error: Invalid job id specified"
            return 0, f"JobId={jid} JobName={j['name']} JobState={j['state']} Reason={j['reason']} ExitCode=1:0 " \
                      f"StdOut=/nonexistent/out\n", ""
        return 127, "", f"{cmd}: not found"

    def sbatches(self) -> list[list[str]]:
        return [argv for argv, _, _ in self.calls if argv[0] == "sbatch"]


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def fake(tmp_path: Path):
    slurm, clock = FakeSlurm(), Clock()
    ex = SlurmExecutor("http://ctl:7350", NodeCredentials(None), tmp_path, run=slurm, clock=clock, poll_interval=0,
                       python="/opt/py/bin/python")
    return slurm, clock, ex, tmp_path


def run(coro):
    return asyncio.run(coro)


def test_time_limits_in_minutes():
    assert [slurm_minutes(x) for x in ("30", "1:30", "01:00:00", "2-12", "1-00:30:00", "UNLIMITED")] == \
        [30, 1.5, 60, 3600, 1470, None]


def test_hostlists_expand():
    assert expand_hostlist("n[1-3,5],gpu01") == ["n1", "n2", "n3", "n5", "gpu01"]
    assert expand_hostlist("node[08-10]") == ["node08", "node09", "node10"]
    assert expand_hostlist("a1") == ["a1"]
    assert expand_hostlist("") == [] and expand_hostlist("(null)") == []


def test_squeue_and_scontrol_are_parsed_defensively():
    text = ("12|rolloutd-a|RUNNING|None|3|n[1-3]|rolloutd uid=u job=a\n"
            "garbage line\n\n"
            "13|x|PENDING|Priority|?||free text | with pipes\n")
    rows = parse_squeue(text)
    assert set(rows) == {"12", "13"}
    assert rows["12"].running and rows["12"].tag() == {"uid": "u", "job": "a"}
    assert rows["13"].nodes == 0 and rows["13"].comment == "free text | with pipes" and rows["13"].tag() == {}
    info = parse_scontrol("JobId=5 JobName=x y UserId=root(0) JobState=FAILED Reason=NonZeroExitCode ExitCode=2:0")
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "2:0"


def test_the_token_travels_in_the_environment_never_on_argv(fake, monkeypatch):
    slurm, _, ex, tmp = fake
    monkeypatch.setenv("ROLLOUTD_TOKEN", "ADMIN-SECRET")
    monkeypatch.setenv("SLURM_JOB_ID", "999")  # a controller that itself runs inside an allocation
    run(ex.ensure(make_job(nodes=3, partition="debug", timeLimit="8:00:00", account="acct", qos="q", constraint="c",
                           extraArgs=["--exclusive"], setup=["module load foo"]), 3))
    (argv, env, script), = [c for c in slurm.calls if c[0][0] == "sbatch"]
    credential = env["ROLLOUTD_JOIN_TOKEN"]
    assert not any("SECRET" in a or credential in a for a in argv) and credential not in script
    assert ex.credentials.job_of(credential) == "j" and env["ROLLOUTD_CONTROLLER"] == "http://ctl:7350"
    assert "ROLLOUTD_TOKEN" not in env and "SLURM_JOB_ID" not in env
    assert any(a.startswith("--signal=TERM@") for a in argv)  # drain before the time limit
    for flag in ("--nodes=3", "--partition=debug", "--time=8:00:00", "--account=acct", "--qos=q", "--constraint=c",
                 "--exclusive", "--export=ALL", "--ntasks-per-node=1"):
        assert flag in argv
    assert "module load foo\n" in script and "srun --ntasks-per-node=1" in script
    assert "/opt/py/bin/python -m rolloutd.agents.daemon --restarts 5" in script and "SECRET" not in script
    assert "SLURM_CONF" not in sanitized_env({"SLURM_NODEID": "1"}) and \
        sanitized_env({"SLURM_CONF": "/c"}) == {"SLURM_CONF": "/c"}
    # idempotent: the next pass submits nothing
    run(ex.ensure(make_job(nodes=3), 3))
    assert len(slurm.sbatches()) == 1


@pytest.mark.parametrize("stderr, reason", [
    ("sbatch: error: Batch job submission failed: Invalid partition name specified", "InvalidPartition"),
    ("sbatch: error: Batch job submission failed: Invalid account or account/partition combination specified",
     "InvalidAccount"),
    ("sbatch: error: Batch job submission failed: Invalid qos specification", "InvalidQOS"),
    ("sbatch: error: Batch job submission failed: Requested time limit is invalid (missing or exceeds some limit)",
     "InvalidTimeLimit"),
    ("sbatch: error: Batch job submission failed: Invalid feature specification", "InvalidConstraint"),
    ("sbatch: unrecognized option '--bogus'", "InvalidSbatchArguments"),
])
def test_refusals_that_no_retry_fixes_fail_the_job_with_slurms_words(fake, stderr, reason):
    slurm, _, ex, _ = fake
    slurm.sbatch_error = (1, stderr)
    with pytest.raises(ExecutorError) as e:
        run(ex.ensure(make_job(), 2))
    assert e.value.permanent and e.value.reason == reason and stderr.split(": ")[-1] in str(e.value)


def test_transient_sbatch_errors_back_off_then_give_up(fake):
    slurm, clock, ex, _ = fake
    slurm.sbatch_error = (1, "sbatch: error: Batch job submission failed: Socket timed out on send/recv operation")
    job = make_job()
    with pytest.raises(ExecutorError) as e:
        run(ex.ensure(job, 2))
    assert not e.value.permanent and e.value.reason == "SlurmSubmitFailed"
    run(ex.ensure(job, 2))  # within the back-off: no new sbatch, no error
    assert len(slurm.sbatches()) == 1
    states = run(ex.observe(job))
    assert states and "Socket timed out" in states[0].reason
    for _ in range(ex.max_failures):
        clock.t += 120
        with pytest.raises(ExecutorError) as e:
            run(ex.ensure(job, 2))
    assert e.value.permanent and len(slurm.sbatches()) == ex.max_failures + 1


def test_allocations_that_keep_dying_young_are_resubmitted_with_back_off_then_fail_the_job(fake):
    slurm, clock, ex, _ = fake
    job = make_job()
    run(ex.ensure(job, 2))
    gaps = []
    with pytest.raises(ExecutorError) as e:
        for _ in range(20):
            for j in slurm.jobs.values():
                if j["state"] == "RUNNING":
                    j["state"] = "FAILED"
            before = len(slurm.sbatches())
            t0 = clock.t
            while len(slurm.sbatches()) == before:
                run(ex.ensure(job, 2))
                clock.t += 1
            gaps.append(clock.t - t0 - 1)
    assert e.value.permanent and e.value.reason == "SlurmAllocationFailed"
    assert "ended FAILED" in str(e.value) and "exit code 1:0" in str(e.value)
    assert gaps[0] == 0 and gaps == sorted(gaps) and gaps[-1] >= 8  # at once, then 2, 4, 8 … seconds
    assert len(slurm.sbatches()) == ex.max_failures + 1  # the first and `max_failures` replacements


def test_a_long_lived_allocation_that_ends_is_replaced_at_once(fake):
    slurm, clock, ex, _ = fake
    job = make_job()
    run(ex.ensure(job, 2))
    for _ in range(8):  # each ran an hour: never a crash loop
        clock.t += 3600
        run(ex.ensure(job, 2))  # seen running
        clock.t += 3600
        for j in slurm.jobs.values():
            j["state"] = "TIMEOUT" if j["state"] == "RUNNING" else j["state"]
        run(ex.ensure(job, 2))
    assert len(slurm.sbatches()) == 9


def test_a_restarted_controller_adopts_allocations_even_without_its_state_file(fake, tmp_path):
    slurm, clock, ex, data = fake
    job = make_job(nodes=2)
    run(ex.ensure(job, 2))
    (data / "slurm-executor.json").unlink()  # died between sbatch and writing its record
    ex2 = SlurmExecutor("http://ctl:7350", NodeCredentials(None), data, run=slurm, clock=clock, poll_interval=0)
    run(ex2.ensure(job, 2))
    assert len(slurm.sbatches()) == 1
    assert [s.state for s in run(ex2.observe(job))] == ["running", "running"]
    # another job's uid under the same name is not adopted as this one
    run(ex2.ensure(make_job(name="other", uid="u-2"), 1))
    assert len(slurm.sbatches()) == 2


def test_an_unreachable_slurm_is_a_transient_condition_never_a_lost_allocation(fake):
    slurm, clock, ex, _ = fake
    job = make_job()
    run(ex.ensure(job, 2))
    slurm.squeue_error = "slurm_load_jobs error: Unable to contact slurm controller (connect failure)"
    for _ in range(3):
        clock.t += 30
        with pytest.raises(ExecutorError) as e:
            run(ex.ensure(job, 2))
        assert not e.value.permanent and e.value.reason == "SlurmUnavailable"
    slurm.squeue_error = None
    run(ex.ensure(job, 2))
    assert len(slurm.sbatches()) == 1


def test_pending_reasons_that_never_resolve_cancel_and_fail(fake):
    slurm, _, ex, _ = fake
    job = make_job()
    run(ex.ensure(job, 2))
    (jid, j), = slurm.jobs.items()
    j["state"], j["reason"] = "PENDING", "InvalidAccount"
    with pytest.raises(ExecutorError) as e:
        run(ex.ensure(job, 2))
    assert e.value.permanent and e.value.reason == "InvalidAccount" and jid in str(e.value)
    assert j["state"] == "CANCELLED"


def test_release_drains_running_allocations_and_cancels_pending_ones(fake):
    slurm, clock, ex, _ = fake
    job = make_job(nodes=2)
    run(ex.ensure(job, 2))
    slurm.jobs["100"]["state"] = "RUNNING"
    run(ex.ensure(make_job(nodes=3), 3))  # grow: a second allocation of one node
    assert [a for a in slurm.sbatches()[-1] if a.startswith("--nodes")] == ["--nodes=1"]
    slurm.jobs["101"]["state"] = "PENDING"
    deleted = make_job(nodes=3)
    deleted.metadata.deletion_timestamp = datetime.now(timezone.utc)
    run(ex.release(deleted))
    scancels = [argv for argv, _, _ in slurm.calls if argv[0] == "scancel"]
    assert ["scancel", "--signal=TERM", "100"] in scancels and ["scancel", "101"] in scancels
    assert slurm.jobs["100"]["state"] == "RUNNING"  # draining: not killed
    clock.t += ex.grace + 1
    run(ex.release(deleted))
    assert ["scancel", "100"] in [argv for argv, _, _ in slurm.calls if argv[0] == "scancel"]
    run(ex.release(deleted))
    assert "j" not in ex.state  # forgotten once Slurm let go of everything
    n = len(slurm.calls)
    run(ex.release(deleted))  # and cheap afterwards
    assert len(slurm.calls) == n


def test_shrinking_retires_whole_allocations_newest_first(fake):
    slurm, clock, ex, _ = fake
    run(ex.ensure(make_job(nodes=2), 2))
    run(ex.ensure(make_job(nodes=3), 3))
    run(ex.ensure(make_job(nodes=2), 2))
    scancels = [argv for argv, _, _ in slurm.calls if argv[0] == "scancel"]
    assert scancels == [["scancel", "--signal=TERM", "101"]]
    assert len(slurm.sbatches()) == 2


def test_a_state_file_of_the_untyped_format_still_loads_and_drives_the_executor(fake):
    """slurm-executor.json as the executor wrote it before its record was typed: same keys, optional ones
    absent (`term_at`, `hard_at`, `drain_at`, `released`). The allocation it names is adopted as is (no
    duplicate sbatch); the retired one still gets its SIGTERM and is forgotten once Slurm ends it."""
    slurm, clock, _, data = fake
    slurm.jobs["100"] = {"name": "rolloutd-j", "state": "RUNNING", "reason": "None", "nodes": 2,
                         "nodelist": "n[1-2]", "comment": "rolloutd uid=u-1 job=j"}
    slurm.jobs["99"] = {"name": "rolloutd-j", "state": "RUNNING", "reason": "None", "nodes": 1,
                        "nodelist": "n3", "comment": "rolloutd uid=u-1 job=j"}
    (data / "slurm-executor.json").write_text(json.dumps({"j": {
        "uid": "u-1", "failures": 0, "next_submit": 0.0, "last_error": "", "submits": 2,
        "allocs": {"100": {"nodes": 2, "submitted": 900.0, "started": 950.0, "nodelist": "n[1-2]", "drained": []}},
        "retired": {"99": {"at": 990.0, "term": False, "hard": False}},
    }}))
    ex = SlurmExecutor("http://ctl:7350", NodeCredentials(None), data, run=slurm, clock=clock, poll_interval=0)
    rec = ex.state["j"]
    assert rec.allocs["100"].started == 950.0 and rec.retired["99"].sigterm_due == 990.0 and rec.submits == 2
    run(ex.ensure(make_job(nodes=2), 2))
    assert slurm.sbatches() == []
    assert ["scancel", "--signal=TERM", "99"] in [argv for argv, _, _ in slurm.calls]
    assert [s.state for s in run(ex.observe(make_job(nodes=2)))] == ["running", "running"]
    slurm.jobs["99"]["state"] = "COMPLETED"
    run(ex.ensure(make_job(nodes=2), 2))
    saved = json.loads((data / "slurm-executor.json").read_text())
    assert saved["j"]["retired"] == {} and saved["j"]["allocs"]["100"]["nodes"] == 2  # same keys on disk


def test_an_unreadable_record_is_dropped_and_its_allocation_adopted_from_slurm(fake):
    slurm, clock, _, data = fake
    slurm.jobs["100"] = {"name": "rolloutd-j", "state": "RUNNING", "reason": "None", "nodes": 2,
                         "nodelist": "n[1-2]", "comment": "rolloutd uid=u-1 job=j"}
    (data / "slurm-executor.json").write_text(json.dumps({"j": {"uid": "u-1", "allocs": {"100": {"nodes": "two"}}}}))
    ex = SlurmExecutor("http://ctl:7350", NodeCredentials(None), data, run=slurm, clock=clock, poll_interval=0)
    assert "j" not in ex.state
    run(ex.ensure(make_job(nodes=2), 2))
    assert slurm.sbatches() == [] and list(ex.state["j"].allocs) == ["100"]
