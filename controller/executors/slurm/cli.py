"""Slurm through its command line: sbatch / squeue / scontrol / scancel, and parsers that tolerate
their output. pyslurm cannot be built against Debian's 22.05, so this is the only way in.

Called by `executor.py`, which decides what to run; `script.py` builds what sbatch submits.
Test seam: the `Runner` (`run(argv, env, input) -> (rc, stdout, stderr)`), a fake Slurm CLI.
"""
from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

from rolloutd.crds import nodeenv

from ..base import ExecutorError
from .script import parse_tag

log = logging.getLogger("rolloutd.executor.slurm")

LIVE = {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED", "REQUEUED", "REQUEUE_HOLD",
        "REQUEUE_FED", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED", "RESV_DEL_HOLD"}
RUNNING = {"RUNNING", "COMPLETING", "CONFIGURING", "SIGNALING", "STAGE_OUT", "RESIZING"}

# Pending reasons that no amount of waiting fixes: the job fails with Slurm's reason.
PERMANENT_PENDING = {
    "InvalidAccount": "the account is invalid",
    "InvalidQOS": "the QOS is invalid",
    "AccountNotAllowed": "the account may not use this partition",
    "QOSNotAllowed": "the QOS may not use this partition",
    "BadConstraints": "no node can satisfy the constraints",
    "PartitionTimeLimit": "the time limit exceeds the partition's maximum",
    "PartitionConfig": "the request does not fit the partition's configuration",
}

# sbatch refusals that a retry will not fix → the condition's reason
SUBMIT_ERRORS: list[tuple[re.Pattern, str]] = [
    (re.compile(r"invalid partition", re.I), "InvalidPartition"),
    (re.compile(r"invalid account|account/partition combination", re.I), "InvalidAccount"),
    (re.compile(r"invalid qos", re.I), "InvalidQOS"),
    (re.compile(r"time limit|--time", re.I), "InvalidTimeLimit"),
    (re.compile(r"invalid feature|constraint", re.I), "InvalidConstraint"),
    (re.compile(r"node count specification|requested node configuration is not available|"
                r"more processors requested than permitted", re.I), "InvalidNodeCount"),
    (re.compile(r"unrecognized option|invalid option|unknown option|invalid argument|invalid .*specification|"
                r"usage:", re.I), "InvalidSbatchArguments"),
    (re.compile(r"access denied|user's group not permitted|not permitted to use", re.I), "AccessDenied"),
]

SQUEUE_FORMAT = "%i|%j|%T|%r|%D|%N|%k"

Runner = Callable[[list[str], dict[str, str], str | None], Awaitable[tuple[int, str, str]]]


async def run_cli(argv: list[str], env: dict[str, str], input_: str | None = None,
                  timeout: float = 60.0) -> tuple[int, str, str]:
    """Run one Slurm command; (returncode, stdout, stderr). A missing binary is rc 127."""
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, env=env, stdin=asyncio.subprocess.PIPE if input_ is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    except FileNotFoundError as e:
        return 127, "", f"{argv[0]}: {e.strerror}"
    try:
        out, err = await asyncio.wait_for(proc.communicate(input_.encode() if input_ is not None else None), timeout)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        return 124, "", f"{argv[0]} timed out after {timeout:g}s"
    return proc.returncode or 0, out.decode(errors="replace"), err.decode(errors="replace")


@dataclass
class SlurmJob:
    """One row of `squeue -t all`."""
    id: str
    name: str
    state: str
    reason: str
    nodes: int
    nodelist: str
    comment: str

    @property
    def live(self) -> bool:
        return self.state in LIVE

    @property
    def running(self) -> bool:
        return self.state in RUNNING

    def tag(self) -> dict[str, str]:
        return parse_tag(self.comment)


class SlurmCli:
    """The Slurm commands the executor runs, with the controller's environment sanitised."""

    def __init__(self, run: Runner | None = None) -> None:
        self._run = run or run_cli
        self._snap: dict[str, SlurmJob] = {}
        self._snap_at = -1e9

    @staticmethod
    def env() -> dict[str, str]:
        return sanitized_env(dict(os.environ))

    async def call(self, *argv: str, input_: str | None = None,
                   env: dict[str, str] | None = None) -> tuple[int, str, str]:
        return await self._run(list(argv), env or self.env(), input_)

    async def squeue(self) -> dict[str, SlurmJob]:
        """Every job of this user that Slurm still knows; ExecutorError when Slurm cannot be asked."""
        rc, out, err = await self.call("squeue", "--me", "-h", "-t", "all", "-o", SQUEUE_FORMAT)
        if rc == 127:
            raise unavailable(last_lines(err))
        if rc != 0:
            raise ExecutorError(f"cannot query Slurm (squeue exit {rc}): {last_lines(err) or 'no output'}",
                                reason="SlurmUnavailable")
        return parse_squeue(out)

    async def jobs(self, max_age: float) -> dict[str, SlurmJob]:
        """`squeue`, cached for `max_age` seconds: one call serves a pass over many RolloutJobs."""
        if time.monotonic() - self._snap_at <= max_age:
            return self._snap
        self._snap, self._snap_at = await self.squeue(), time.monotonic()
        return self._snap

    def invalidate(self) -> None:
        """Slurm changed (sbatch, scancel, scontrol update): the next `jobs` asks again."""
        self._snap_at = -1e9

    async def sbatch(self, argv: list[str], script: str, env: dict[str, str]) -> tuple[str | None, int, str]:
        """Submit; (allocation id, rc, Slurm's last words). The id is None when sbatch refused."""
        rc, out, err = await self.call(*argv, input_=script, env=env)
        if rc == 0 and out.strip():
            return out.strip().split(";")[0].strip(), rc, ""
        return None, rc, last_lines(err or out) or f"sbatch exited {rc}"

    async def scancel(self, alloc_id: str, *, term: bool = False) -> None:
        """`scancel` (`--signal=TERM` only signals the processes: the daemons drain); failures are logged."""
        argv = ("scancel", "--signal=TERM", alloc_id) if term else ("scancel", alloc_id)
        rc, _, err = await self.call(*argv)
        if rc != 0:
            log.warning("%s: %s", " ".join(argv), last_lines(err))

    async def show_job(self, alloc_id: str) -> dict[str, str]:
        """`scontrol show job` as {key: value}; {} when Slurm no longer knows the job."""
        rc, out, _ = await self.call("scontrol", "show", "job", alloc_id, "-o")
        return parse_scontrol(out) if rc == 0 else {}

    async def keep_nodes(self, alloc_id: str, keep: list[str]) -> str | None:
        """Give every node but `keep` back to Slurm; Slurm's error, or None when it did."""
        rc, _, err = await self.call("scontrol", "update", f"JobId={alloc_id}", f"NodeList={','.join(keep)}")
        return None if rc == 0 else last_lines(err) or f"scontrol exited {rc}"


def unavailable(text: str) -> ExecutorError:
    return ExecutorError(f"Slurm is not available on this controller: {text}", reason="SlurmUnavailable",
                         permanent=True)


def refusal(text: str) -> str | None:
    """The condition reason of an sbatch refusal that no retry will fix; None for a transient one."""
    return next((reason for pattern, reason in SUBMIT_ERRORS if pattern.search(text)), None)


def expand_hostlist(spec: str) -> list[str]:
    """Slurm hostlist → names: 'n[1-3,5],gpu01' → n1 n2 n3 n5 gpu01 (zero padding kept)."""
    names: list[str] = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\][^,\[]*)*", spec.strip()):
        m = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", part)
        if not m:
            if part and part not in ("(null)", "None"):
                names.append(part)
            continue
        prefix, ranges, suffix = m.groups()
        for r in ranges.split(","):
            lo, _, hi = r.partition("-")
            if hi and lo.isdigit() and hi.isdigit():
                width = len(lo)
                names += [f"{prefix}{i:0{width}d}{suffix}" for i in range(int(lo), int(hi) + 1)]
            elif lo:
                names.append(f"{prefix}{lo}{suffix}")
    return names


def parse_squeue(text: str) -> dict[str, SlurmJob]:
    out: dict[str, SlurmJob] = {}
    for line in text.splitlines():
        parts = line.strip().split("|", 6)
        if len(parts) != 7 or not parts[0]:
            continue
        jid, name, state, reason, nodes, nodelist, comment = parts
        state = state.strip().split()[0].rstrip("+") if state.strip() else "UNKNOWN"
        try:
            n = int(nodes)
        except ValueError:
            n = 0
        out[jid.strip()] = SlurmJob(jid.strip(), name, state.upper(), reason.strip(), n, nodelist.strip(),
                                    comment.strip())
    return out


def parse_scontrol(text: str) -> dict[str, str]:
    """`scontrol show job ID -o` → {key: value} (values with spaces keep their first word)."""
    return dict(re.findall(r"(?:^|\s)([A-Za-z:/]+)=(\S*)", text))


def sanitized_env(base: dict[str, str]) -> dict[str, str]:
    """The controller's environment without Slurm variables of its own (SLURM_CONF stays) and
    without its admin API token."""
    return {k: v for k, v in base.items()
            if not (k.startswith("SLURM_") and k != "SLURM_CONF") and not k.startswith("SBATCH_")
            and not k.startswith("SALLOC_") and not k.startswith("SRUN_") and k != nodeenv.ADMIN_TOKEN}


def last_lines(text: str, n: int = 2) -> str:
    lines = [ln.strip() for ln in (text or "").strip().splitlines() if ln.strip()]
    return " | ".join(lines[-n:])


def read_tail(path: str, size: int = 4096) -> str:
    """The end of an allocation's output file (why it died), "" when there is none to read."""
    if not path or path in ("(null)", "/dev/null"):
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(f.tell() - size, 0))
            return f.read().decode(errors="replace")
    except OSError:
        return ""
