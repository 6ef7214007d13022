"""`Store.cached`, which the trainer routes read on the event loop (`http/trainer.py`): the parsed job `get` would
return while no write has touched it since it was read, None otherwise (the route then reads it in a thread)."""
from __future__ import annotations

from rolloutd.controller.store import Store
from rolloutd.crds.rolloutjob import RolloutJob

from support.example_job import example_doc


def test_cached_is_what_get_returns_until_a_write_and_none_after(store_location):
    store = Store(store_location)
    job = RolloutJob.model_validate(example_doc())
    store.apply(job)
    key = job.metadata.key
    assert store.cached(key) is None  # nothing read since the write
    got = store.get(key)
    assert store.cached(key) is got

    changed = job.model_copy(deep=True)
    changed.metadata.labels = {"team": "b"}
    store.apply(changed)
    assert store.cached(key) is None  # the old copy is not served after the write
    assert store.get(key).metadata.labels == {"team": "b"}
    assert store.cached("default/no-such-job") is None
