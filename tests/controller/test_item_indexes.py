"""The items table carries the indexes its hot queries search by, and no index that repeats another's prefix
(each one is rewritten at every state change: WAL pages for nothing); an older database loses them at start."""
from sqlmodel import create_engine

from rolloutd.controller.work import tables

HOT = {  # query → the index it must search
    "SELECT id FROM items WHERE job = ? AND state = ? ORDER BY id LIMIT ?": "ix_items_job_state",  # lease
    "SELECT 1 FROM items WHERE job = ? AND state IN ('queued', 'leased') LIMIT 1": "ix_items_job_state",  # idle?
    "SELECT * FROM items WHERE state = 'leased' AND deadline < ?": "ix_items_state_deadline",  # expiry
    "SELECT * FROM items WHERE attempt_id IN (?, ?)": "ix_items_attempt_id",  # beats, results
    "SELECT count(*) FROM items WHERE node_id = ? AND +job = ? AND +state = ?": "ix_items_node_id",  # fair share
}


def _indexes(engine) -> set[str]:
    with engine.connect() as c:
        return {r[0] for r in c.exec_driver_sql("SELECT name FROM sqlite_master WHERE type = 'index' "
                                                "AND tbl_name = 'items' AND sql IS NOT NULL")}


def test_hot_queries_search_an_index_and_no_index_repeats_a_prefix(tmp_path):
    engine = create_engine(f"sqlite:///{tmp_path / 'db.sqlite'}")
    tables.create(engine)
    assert "ix_items_job" not in _indexes(engine) and "ix_items_state" not in _indexes(engine)
    with engine.connect() as c:
        for query, index in HOT.items():
            plan = " ".join(r[3] for r in c.exec_driver_sql("EXPLAIN QUERY PLAN " + query, (1,) * query.count("?")))
            assert f"INDEX {index}" in plan and "SCAN" not in plan, (query, plan)


def test_an_older_database_drops_the_redundant_indexes(tmp_path):
    engine = create_engine(f"sqlite:///{tmp_path / 'db.sqlite'}")
    tables.create(engine)
    with engine.begin() as c:  # as a database from before: both indexes present
        c.exec_driver_sql("CREATE INDEX ix_items_job ON items (job)")
        c.exec_driver_sql("CREATE INDEX ix_items_state ON items (state)")
    assert {"ix_items_job", "ix_items_state"} <= _indexes(engine)
    tables.create(engine)
    assert not {"ix_items_job", "ix_items_state"} & _indexes(engine)
