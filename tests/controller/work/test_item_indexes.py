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
