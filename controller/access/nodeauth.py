"""Node credentials: one per job, minted when an executor starts the job's daemons, revoked on release;
and one per node, derived from its job's at registration, so a node acts only as itself.

    job credential   random; registers nodes for its job only (`mint` by the executors, `revoke` on release;
                     a job re-created under the same name gets a new one: the record names the job's uid)
    node token       HMAC(job credential, node id): every per-node call (lease, heartbeat, results, return,
                     deregister) of that node and no other; nothing to store, so it survives a restart and
                     dies with its job's credential

Kept in `node-credentials.json` (0600, in the data dir beside the admin token) so daemons that outlive a
controller restart keep working. Checked by `NodeGate` in the API middleware (`middleware.py`): two dict lookups
and one HMAC per call, whatever the number of nodes. The register routes (`http/node_protocol.py`) compare the
body's job with the credential's (`request.state.node_job`).
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
import threading
import time
from pathlib import Path
from typing import Callable

from rolloutd.crds.names import API_PREFIX, job_key
from rolloutd.crds.rolloutjob import RolloutJob

_NODE_PATH = re.compile(re.escape(API_PREFIX) + r"(?:/namespaces/([^/]+)/rolloutjobs/([^/]+))?/nodes/([^/]+)(/[^/]+)?")


class NodeCredentials:
    """The job credentials, by job key and by token, persisted on every change (minting and revoking are rare)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._by_job: dict[str, tuple[str, str]] = {}  # job key → (uid, credential)
        self._by_token: dict[str, str] = {}  # credential → job key
        self._read = (0.0, 0.0)  # (when the file was last looked at, its mtime then)
        self._load()

    def _load(self) -> None:
        path = self.path
        if path is not None and path.exists():
            by_job: dict[str, tuple[str, str]] = {}
            try:
                self._read = (time.monotonic(), path.stat().st_mtime)
                for key, rec in json.loads(path.read_text()).items():
                    by_job[key] = (str(rec["uid"]), str(rec["credential"]))
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                by_job = {}  # an unreadable record grants nothing; the executors mint anew
            self._by_job, self._by_token = by_job, {cred: key for key, (_, cred) in by_job.items()}

    def _fresh(self) -> None:
        """Replicas sharing the data dir (`replicas.py`): the leader's executors mint and revoke; another replica
        serving node calls (`shards.py`) reads the file again when it changed (looked at once a second at most)."""
        if self.path is None or time.monotonic() - self._read[0] < 1.0:
            return
        try:
            mtime = self.path.stat().st_mtime
        except OSError:
            return
        if mtime != self._read[1]:
            with self._lock:
                self._load()
        else:
            self._read = (time.monotonic(), mtime)

    def mint(self, job: RolloutJob) -> str:
        """The job's credential: the one it has, or a new one (first start, or the job was re-created)."""
        key, uid = job.metadata.key, job.metadata.uid or ""
        with self._lock:
            rec = self._by_job.get(key)
            if rec is not None and rec[0] == uid:
                return rec[1]
            if rec is not None:
                self._by_token.pop(rec[1], None)
            cred = secrets.token_urlsafe(32)
            self._by_job[key], self._by_token[cred] = (uid, cred), key
            self._save()
            return cred

    def revoke(self, job: RolloutJob) -> None:
        """The job was released: its credential, and every node token derived from it, stop working (a job
        re-created under the same name keeps its own)."""
        key, uid = job.metadata.key, job.metadata.uid or ""
        with self._lock:
            rec = self._by_job.get(key)
            if rec is None or rec[0] != uid:
                return
            del self._by_job[key]
            self._by_token.pop(rec[1], None)
            self._save()

    def minted_for(self, job: RolloutJob) -> bool:
        """The job's credential was minted for this very job (not an earlier one of the same name)."""
        rec = self._by_job.get(job.metadata.key)
        return rec is not None and rec[0] == (job.metadata.uid or "")

    def job_of(self, token: str) -> str | None:
        """The job a credential registers nodes for; None for anything else."""
        self._fresh()
        return self._by_token.get(token)

    def node_token(self, job_key: str, node_id: str) -> str | None:
        """The token of node `node_id` of `job_key` (None: the job holds no credential)."""
        self._fresh()
        rec = self._by_job.get(job_key)
        if rec is None:
            return None
        return hmac.new(rec[1].encode(), node_id.encode(), hashlib.sha256).hexdigest()

    def _save(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({k: {"uid": u, "credential": c} for k, (u, c) in self._by_job.items()}, f)
        tmp.replace(self.path)


class NodeGate:
    """Who may make a node-protocol call: `check(path, bearer)` → (allowed, the job a job credential registers
    for). `node_job(node_id)`: the scheduler's record of a node's job."""

    def __init__(self, credentials: NodeCredentials, node_job: Callable[[str], str | None]) -> None:
        self.credentials, self.node_job = credentials, node_job

    @staticmethod
    def is_node_path(path: str) -> bool:
        return _NODE_PATH.fullmatch(path) is not None

    def check(self, path: str, bearer: str | None) -> tuple[bool, str | None]:
        m = _NODE_PATH.fullmatch(path)
        if m is None or not bearer:
            return False, None
        namespace, name, node_id, verb = m.groups()
        if verb is None:  # …/nodes/register: the job credential, and the path's job when it names one
            job = self.credentials.job_of(bearer) if node_id == "register" else None
            if job is None or (namespace is not None and job != job_key(namespace, name)):
                return False, None
            return True, job
        job = self.node_job(node_id)
        if job is None or (namespace is not None and job != job_key(namespace, name)):
            return False, None
        expected = self.credentials.node_token(job, node_id)
        return expected is not None and hmac.compare_digest(bearer.encode(), expected.encode()), None
