"""Operator mode's local copy of the RolloutJobs it reconciles on another API server, so that the
scheduler and the trainer API beside the handlers read the jobs from their own SQLite store.

Wired by `server.build_app(kube=…)`; called by the handlers (`handlers.Reconciler`) on every pass and
on release. Next step: the store (`controller/store/`).
"""
from __future__ import annotations

from rolloutd.crds.rolloutjob import RolloutJob

from ..errors import NotFound
from ..store import Store


class StoreMirror:
    def __init__(self, store: Store):
        self.store = store

    def put(self, job: RolloutJob) -> None:
        """Create or update the local copy: spec, labels, annotations and status as the API server has them."""
        name = job.metadata.key  # the store's key: the name in `default`, else namespace/name
        local = job.model_copy(deep=True)
        local.metadata.resource_version = None
        local.metadata.finalizers = []
        try:
            current = self.store.get(name)
        except NotFound:
            current = None
        if current is not None and current.metadata.uid != job.metadata.uid:  # re-created under the same name
            self.drop(current)
            current = None
        if current is None:
            self.store.create(local, uid=job.metadata.uid)
        else:
            self.store.update(local)
        self.store.update_status(name, job.status)

    def drop(self, job: RolloutJob) -> None:
        """The job was released on the API server: delete the local copy (trajectories included)."""
        try:
            self.store.mark_deleted(job.metadata.key)
        except NotFound:
            return
        self.store.remove(job.metadata.key)
