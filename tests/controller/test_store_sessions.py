"""The PostgreSQL store's sessions (controller/store/db.py) on the real server: each carries this process's name
(what a replica taking over from this one ends, `replica_tables.end_sessions`), and one left idle inside a
transaction (a paused process's) is ended by the server, so what it locked holds another writer only that long."""
from __future__ import annotations

import pytest
from sqlalchemy import create_engine

from rolloutd.controller import dialects
from rolloutd.controller.store import Store
from rolloutd.controller.store.replica_tables import SESSION


def test_a_transaction_left_idle_by_a_paused_process_is_ended_and_frees_its_locks(pg_server, monkeypatch):
    monkeypatch.setattr(dialects, "IDLE_IN_TRANSACTION_SECONDS", 1)
    location = pg_server.create_database()
    store = Store(location)
    other = create_engine(dialects.engine_url(location), connect_args={"options": "-c statement_timeout=30s"})
    try:
        with other.begin() as c:
            c.exec_driver_sql("CREATE TABLE work (x INTEGER)")
            c.exec_driver_sql("INSERT INTO work VALUES (1)")
        paused = store.engine.connect()
        paused.begin()
        paused.exec_driver_sql("UPDATE work SET x = 10")  # its row lock; then the process stops answering
        with other.connect() as c:
            names = {n for (n,) in c.exec_driver_sql("SELECT application_name FROM pg_stat_activity "
                                                     "WHERE datname = current_database()")}
        assert SESSION in names
        with other.begin() as c:  # waits for the lock until the server ends the idle session (bounded: 30 s)
            c.exec_driver_sql("UPDATE work SET x = x + 1")
        with pytest.raises(Exception, match="terminat|closed|timeout"):
            paused.commit()
        with other.connect() as c:
            assert c.exec_driver_sql("SELECT x FROM work").scalar() == 2
    finally:
        store.engine.dispose()
        other.dispose()
