"""Schema versions on both stores: a controller older than its database's schema refuses to start (its reason
on stderr, the database untouched) rather than write rows a newer rolloutd would misread."""
from __future__ import annotations

import subprocess
import sys

import pytest

from rolloutd.controller.store import Store
from rolloutd.controller.store import db
from rolloutd.controller.store.db import SchemaTooNew, ServerTooOld
from rolloutd.controller.store.schema import SCHEMA_VERSION

from support.controller_process import free_port
from rolloutd.crds.rolloutjob import RolloutJob
from support.example_job import example_doc


def test_an_older_rolloutd_refuses_a_newer_database_and_leaves_it_as_it_was(tmp_path, store_location):
    store = Store(store_location)
    store.apply(RolloutJob.model_validate(example_doc()))
    with store.engine.begin() as c:  # what a newer rolloutd's migration leaves
        c.exec_driver_sql(f"UPDATE schema_version SET version = {SCHEMA_VERSION + 1}")
    store.engine.dispose()

    with pytest.raises(SchemaTooNew, match=f"schema version {SCHEMA_VERSION + 1}, newer than this rolloutd"):
        Store(store_location)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "token").write_text("the-clients-token\n")  # the store's clients' token, kept beside it
    done = subprocess.run([sys.executable, "-m", "rolloutd.controller.main", "controller", "--data-dir",
                           str(tmp_path / "data"), "--store", str(store_location), "--port", str(free_port()),
                           "--executors", ""], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert f"newer than this rolloutd ({SCHEMA_VERSION})" in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr

    with store.engine.connect() as c:
        assert c.exec_driver_sql("SELECT version FROM schema_version").scalar_one() == SCHEMA_VERSION + 1
        assert c.exec_driver_sql("SELECT count(*) FROM jobs").scalar_one() == 1


REPLICA_TABLES = {"leader_lease", "node_owners", "node_owner_deletions", "replica_members", "replica_stages"}
# what the replicas' own CREATE statements made before schema 4 (the lease row held; an owner row without `moves`)
V3_REPLICA_TABLES = (
    "DROP TABLE leader_lease", "DROP TABLE node_owners", "DROP TABLE node_owner_deletions", "DROP TABLE replica_members",
    "DROP TABLE replica_stages",
    "CREATE TABLE leader_lease (id INTEGER PRIMARY KEY, holder TEXT NOT NULL, epoch BIGINT NOT NULL, "
    "expires DOUBLE PRECISION NOT NULL, url TEXT NOT NULL)",
    "INSERT INTO leader_lease VALUES (1, 'old-leader', 7, 0, 'http://a')",
    "CREATE TABLE node_owners (node_id TEXT PRIMARY KEY, owner TEXT NOT NULL)",
    "INSERT INTO node_owners VALUES ('n1', 'http://a')",
    "UPDATE schema_version SET version = 3")


def _tables(location) -> set[str]:
    from sqlalchemy import create_engine, inspect

    from rolloutd.controller import dialects

    engine = create_engine(dialects.engine_url(location) if dialects.is_url(location) else f"sqlite:///{location}")
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def _indexes(location, table: str) -> set[str]:
    from sqlalchemy import create_engine, inspect

    from rolloutd.controller import dialects

    engine = create_engine(dialects.engine_url(location) if dialects.is_url(location) else f"sqlite:///{location}")
    try:
        return {i["name"] for i in inspect(engine).get_indexes(table)}
    finally:
        engine.dispose()


def test_an_upgrade_from_schema_3_makes_the_replicas_tables_and_keeps_their_rows(store_location):
    """A v3 database (the lease and shard tables made, if at all, by the replicas' own statements) opens at the current
    version with all five tables, the lease's epoch and the owner rows kept, `moves` (v4) and `stamp` (v5, indexed)
    added, the owner deletions' record (v6) made, the lease and members naming their sessions (v7: '' until renewed; a
    v3 rolloutd is then refused, as above)."""
    store = Store(store_location)
    with store.engine.begin() as c:
        for sql in V3_REPLICA_TABLES:
            c.exec_driver_sql(sql)
    store.engine.dispose()
    assert REPLICA_TABLES - _tables(store_location) == {"replica_members", "replica_stages", "node_owner_deletions"}

    store = Store(store_location)
    assert store.schema_version() == SCHEMA_VERSION == 7
    assert REPLICA_TABLES <= _tables(store_location)
    assert "ix_node_owners_stamp" in _indexes(store_location, "node_owners")
    assert "ix_node_owner_deletions_stamp" in _indexes(store_location, "node_owner_deletions")
    with store.engine.connect() as c:
        assert c.exec_driver_sql("SELECT holder, epoch, session FROM leader_lease").all() == [("old-leader", 7, "")]
        assert c.exec_driver_sql("SELECT count(session) FROM replica_members").scalar_one() == 0
        assert c.exec_driver_sql("SELECT node_id, owner, moves, stamp FROM node_owners").all() == [("n1", "http://a", 0, 0)]
        assert c.exec_driver_sql("SELECT count(*) FROM replica_members").scalar_one() == 0
    store.engine.dispose()


def test_a_new_database_has_the_replicas_tables_and_the_replicas_create_none(store_location, new_store_location):
    """The tables come with the schema (the lease row seeded); `Leadership` and `Shards` on a database the store
    never opened create nothing: the election fails there rather than make a table outside the migrations."""
    from sqlalchemy import create_engine

    from rolloutd.controller import dialects
    from rolloutd.controller.ha.leadership import Leadership
    from rolloutd.controller.ha.shards import Shards

    store = Store(store_location)
    assert REPLICA_TABLES <= _tables(store_location)
    with store.engine.connect() as c:
        assert c.exec_driver_sql("SELECT id, holder, epoch FROM leader_lease").all() == [(1, "", 0)]
    assert Leadership(store.engine, "http://a", holder="a").try_take() == 1
    store.engine.dispose()

    bare = new_store_location()  # never opened by a Store
    engine = create_engine(dialects.engine_url(bare) if dialects.is_url(bare) else f"sqlite:///{bare}")
    try:
        leadership = Leadership(engine, "http://a", holder="a")
        if dialects.is_url(bare):
            Shards(engine, "http://a")
        with pytest.raises(Exception, match="leader_lease"):
            leadership.try_take()
    finally:
        engine.dispose()
    assert _tables(bare) == set()


def test_a_postgresql_server_older_than_the_oldest_supported_is_refused_naming_its_version(pg_server, monkeypatch):
    """The real server's version against a raised floor (no older server runs here): refused before any table is
    made, the message naming the server's version and the one needed."""
    location = pg_server.create_database()
    monkeypatch.setattr(db, "PG_OLDEST", (99,))
    with pytest.raises(ServerTooOld, match=r"runs version 1\d\.\d+; rolloutd needs 99 or newer"):
        Store(location)
    monkeypatch.undo()
    store = Store(location)  # the same database, untouched: the floor met, it is made as any new one
    assert store.schema_version() == SCHEMA_VERSION
