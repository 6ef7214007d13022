"""quotas.itemsPerJob over a batch job's life, read from its counter of opened rollouts (`work/opened.py`) instead of
a count of its items at every step (issue 36: a 100 000-group fill scanned up to 800 000 rows a step): each batch's
rollouts add up to the quota and the request past it is refused before anything opens; the counter is the job's
items exactly; a database without the counter row (from before it) counts the items once. On SQLite and
PostgreSQL (the `store_location` fixture's stores)."""
from __future__ import annotations

import pytest
from sqlalchemy import text
from sqlmodel import Session

from rolloutd.controller.errors import Forbidden

from .test_batches import lease_all, make, report

QUOTA = 40  # rollouts: two batches of 4 groups × 4 samples fit (32), a third does not (48)


def _counts(sched) -> tuple[int, int]:
    """(the counter, the job's items)."""
    with Session(sched.work.store.engine) as s:
        counter = s.exec(text("SELECT items FROM opened_items WHERE job = 'math-demo'")).first()
        items = s.exec(text("SELECT count(*) FROM items WHERE job = 'math-demo'")).one()[0]
    return (None if counter is None else counter[0]), items


def _run_batch(sched, node) -> None:
    sched.request_batch("math-demo")
    while leases := lease_all(sched, node):
        report(sched, node, leases, lambda p, s: 1.0)


def test_the_item_quota_holds_over_batches_from_the_counter_and_from_an_older_database(tmp_path, store_location):
    store, sched, node = make(tmp_path, store_location, dapo=False, samples=4, batches={"groups": 4})
    sched.work.batches.item_quota = lambda job: QUOTA
    _run_batch(sched, node)
    assert _counts(sched) == (16, 16)
    with Session(store.engine) as s:  # a database from before the counter: no row
        s.exec(text("DELETE FROM opened_items"))
        s.commit()
    _run_batch(sched, node)
    assert _counts(sched) == (32, 32)  # counted once from the items, then kept: over the job's life
    with pytest.raises(Forbidden, match="may open 8 more rollouts"):
        sched.request_batch("math-demo")
    assert _counts(sched) == (32, 32)  # nothing opened
