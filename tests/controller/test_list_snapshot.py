"""A list and the resourceVersion a watch resumes from come from one snapshot: a job written while the list is
read is either in it or replayed by the watch after it — never in neither (kopf, starting while a job was being
applied, once never saw the job: it stayed Pending)."""
from __future__ import annotations

from pathlib import Path

import yaml
from sqlalchemy import event

from rolloutd.controller.store import Store
from rolloutd.crds.rolloutjob import RolloutJob

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "math-demo.yaml"


def job(name: str) -> RolloutJob:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"]["name"] = name
    return RolloutJob.model_validate(doc)


def test_a_job_written_during_a_list_is_listed_or_after_its_version(store_location):
    store = Store(store_location)
    store.apply(job("first"))
    written: list[str] = []

    def write_once_after_reading_jobs(conn, cursor, statement, *args):
        if not written and "FROM jobs" in statement and conn.info.get("listing"):
            written.append("late")
            conn.info["listing"] = False
            store.apply(job("late"))  # another connection, between this statement and any that follows

    event.listen(store.engine, "after_cursor_execute", write_once_after_reading_jobs)
    try:
        with store.engine.connect() as c:  # mark the pooled connection the list will use
            c.info["listing"] = True
        items, rv = store.list_wire()
    finally:
        event.remove(store.engine, "after_cursor_execute", write_once_after_reading_jobs)
    assert written == ["late"]
    listed = {i["metadata"]["name"] for i in items}
    late_rv = int(store.get_wire("late")["metadata"]["resourceVersion"])
    assert "late" in listed or late_rv > rv, (listed, rv, late_rv)
