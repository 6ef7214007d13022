"""A schema-1 database (before namespaces) opens in this version: its jobs land in `default`, hold the
release finalizer and keep everything else; the schema version is recorded."""
from __future__ import annotations

import json
import sqlite3

from support.kube_helpers import job_doc

from rolloutd.controller.store import Store
from rolloutd.controller.store.schema import RELEASE_FINALIZER, SCHEMA_VERSION
from rolloutd.crds.rolloutjob import RolloutJob

V1_TABLES = """
CREATE TABLE schema_version (id INTEGER NOT NULL PRIMARY KEY, version INTEGER NOT NULL);
CREATE TABLE jobs (name VARCHAR NOT NULL PRIMARY KEY, uid VARCHAR NOT NULL, generation INTEGER NOT NULL,
    resource_version INTEGER NOT NULL, labels VARCHAR NOT NULL, annotations VARCHAR NOT NULL, spec VARCHAR NOT NULL,
    status VARCHAR NOT NULL, created DATETIME NOT NULL, deleted DATETIME);
CREATE TABLE changes (rv INTEGER NOT NULL PRIMARY KEY, type VARCHAR NOT NULL, name VARCHAR NOT NULL,
    object VARCHAR NOT NULL);
CREATE TABLE events (id INTEGER NOT NULL PRIMARY KEY, name VARCHAR NOT NULL, time DATETIME NOT NULL,
    type VARCHAR NOT NULL, reason VARCHAR NOT NULL, message VARCHAR NOT NULL);
INSERT INTO schema_version VALUES (1, 1);
"""


def test_a_v1_database_migrates_into_the_default_namespace(tmp_path):
    db = tmp_path / "rolloutd.db"
    spec = RolloutJob.model_validate(job_doc("old-job")).spec.wire()
    with sqlite3.connect(db) as conn:
        conn.executescript(V1_TABLES)
        conn.execute("INSERT INTO jobs VALUES ('old-job', 'u-1', 3, 7, ?, '{}', ?, ?, '2026-01-01 00:00:00', NULL)",
                     (json.dumps({"team": "rl"}), json.dumps(spec), json.dumps({"phase": "Running"})))
        conn.execute("INSERT INTO changes VALUES (7, 'MODIFIED', 'old-job', '{}')")
    store = Store(db)
    assert store.schema_version() == SCHEMA_VERSION == 7
    wire = store.get_wire("old-job", "default")
    meta = wire["metadata"]
    assert meta["namespace"] == "default" and meta["finalizers"] == [RELEASE_FINALIZER]
    assert (meta["uid"], meta["generation"], meta["resourceVersion"], meta["labels"]) == ("u-1", 3, "7", {"team": "rl"})
    assert wire["spec"] == spec and wire["status"]["phase"] == "Running"
    store.mark_deleted("old-job")  # the reconciler's release removes it, as for a job created now
    store.remove("old-job")
    assert store.names() == []
    assert Store(db).schema_version() == SCHEMA_VERSION  # opening again migrates nothing twice


def test_a_v2_database_rekeys_jobs_outside_default_and_one_name_then_lives_in_two_namespaces(tmp_path):
    db = tmp_path / "rolloutd.db"
    store = Store(db)  # a fresh database, then put back to v2 by hand: the v2 jobs table and v2 keys
    spec = json.dumps(RolloutJob.model_validate(job_doc("a")).spec.wire())
    with sqlite3.connect(db) as conn:
        conn.executescript("DROP TABLE jobs; UPDATE schema_version SET version = 2;"
                           "DROP TABLE IF EXISTS items; CREATE TABLE items (id INTEGER PRIMARY KEY, job VARCHAR NOT NULL);")
        conn.executescript(V1_TABLES.split(";")[1] + ";")  # the v1/v2 jobs table: name alone is the key
        for ddl in ("namespace VARCHAR NOT NULL DEFAULT 'default'", "finalizers VARCHAR NOT NULL DEFAULT '[]'",
                    "owner_refs VARCHAR NOT NULL DEFAULT '[]'", "managed VARCHAR NOT NULL DEFAULT '[]'"):
            conn.execute(f"ALTER TABLE jobs ADD COLUMN {ddl}")
        for name, ns in (("a", "team"), ("b", "default")):
            conn.execute("INSERT INTO jobs (name, namespace, uid, generation, resource_version, labels, annotations, "
                         "spec, status, created) VALUES (?, ?, 'u', 1, 1, '{}', '{}', ?, '{}', '2026-01-01 00:00:00')",
                         (name, ns, spec))
            conn.execute("INSERT INTO items (job) VALUES (?)", (name,))
            conn.execute("INSERT INTO events (name, time, type, reason, message) VALUES (?, '2026-01-01', 'Normal', "
                         "'Made', 'x')", (name,))
    del store
    store = Store(db)
    assert store.schema_version() == SCHEMA_VERSION
    assert sorted(store.names()) == ["b", "team/a"]
    with sqlite3.connect(db) as conn:
        assert sorted(r[0] for r in conn.execute("SELECT job FROM items")) == ["b", "team/a"]
    assert [e["reason"] for e in store.events("team/a")] == ["Made"]
    assert store.get("team/a").metadata.namespace == "team"
    store.create(RolloutJob.model_validate(job_doc("a")))  # the same name, now in `default` too
    assert store.get("a").metadata.namespace == "default" and store.get("team/a").metadata.namespace == "team"
    store.mark_deleted("a", "team")
    store.remove("team/a")
    assert sorted(store.names()) == ["a", "b"]
