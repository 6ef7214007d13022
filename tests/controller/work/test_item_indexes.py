"""The items table carries the indexes its hot queries search by, and no index that repeats another's prefix or
serves what memory answers (each one is rewritten at every state change: WAL pages for nothing); an older
database loses them at start."""
from sqlmodel import create_engine

from rolloutd.controller.work import tables

HOT = {  # query → how it must search (the index; covering: no row read)
    "SELECT id FROM items WHERE job = ? AND state = ? ORDER BY id LIMIT ?": "INDEX ix_items_job_state",  # lease
    "SELECT 1 FROM items WHERE job = ? AND state IN ('queued', 'leased') LIMIT 1": "INDEX ix_items_job_state",  # idle?
    "SELECT * FROM items WHERE state = 'leased'": "INDEX ix_items_state_deadline",  # a restart loads the leases
    "SELECT * FROM items WHERE attempt_id IN (?, ?)": "INDEX ix_items_attempt_id",  # beats, results
    "SELECT state, count(*) FROM items WHERE job = ? GROUP BY state": "COVERING INDEX ix_items_job_state",  # status
}
GONE = {"ix_items_job", "ix_items_state", "ix_items_node_id"}  # a prefix repeated, or counted in memory now


def _indexes(engine) -> set[str]:
    with engine.connect() as c:
        return {r[0] for r in c.exec_driver_sql("SELECT name FROM sqlite_master WHERE type = 'index' "
                                                "AND tbl_name = 'items' AND sql IS NOT NULL")}


def test_hot_queries_search_an_index_and_no_index_repeats_a_prefix(tmp_path):
    engine = create_engine(f"sqlite:///{tmp_path / 'db.sqlite'}")
    tables.create(engine)
    assert not GONE & _indexes(engine)
    with engine.connect() as c:
        for query, index in HOT.items():
            plan = " ".join(r[3] for r in c.exec_driver_sql("EXPLAIN QUERY PLAN " + query, (1,) * query.count("?")))
            assert index in plan and "SCAN items" not in plan, (query, plan)


def test_an_older_database_drops_the_indexes_it_no_longer_needs(tmp_path):
    engine = create_engine(f"sqlite:///{tmp_path / 'db.sqlite'}")
    tables.create(engine)
    with engine.begin() as c:  # as a database from before: the indexes present
        c.exec_driver_sql("CREATE INDEX ix_items_job ON items (job)")
        c.exec_driver_sql("CREATE INDEX ix_items_state ON items (state)")
        c.exec_driver_sql("CREATE INDEX ix_items_node_id ON items (node_id)")
    assert GONE <= _indexes(engine)
    tables.create(engine)
    assert not GONE & _indexes(engine)


def test_a_lease_on_postgresql_finds_the_queued_items_by_index_however_many_are_leased_or_done(pg_server):
    """A lease takes the job's first queued items by id. With 60 000 items already leased or done ahead of them,
    PostgreSQL must find them through the index's condition, not by walking the primary key and filtering (which
    made every lease at 1000 nodes cost tens of milliseconds and stalled `bench scale` on PostgreSQL)."""
    from rolloutd.controller import dialects

    engine = create_engine(dialects.engine_url(pg_server.create_database()))
    tables.create(engine)
    with engine.begin() as c:
        c.exec_driver_sql("INSERT INTO items (job, prompt, sample, state, attempt, queued_at, holds_backend, last_error) SELECT 'j', g / 8, "
                          "mod(g, 8), CASE WHEN g < 60000 THEN 'done' ELSE 'queued' END, 0, 0, false, '' "
                          "FROM generate_series(1, 80000) g")
        c.exec_driver_sql("ANALYZE items")
        plan = "\n".join(r[0] for r in c.exec_driver_sql(
            "EXPLAIN SELECT id FROM items WHERE job = 'j' AND state = 'queued' ORDER BY id LIMIT 64 "
            "FOR UPDATE SKIP LOCKED"))
    engine.dispose()
    assert "ix_items_job_state_id" in plan and "Filter" not in plan, plan
