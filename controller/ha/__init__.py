"""Several controllers on one PostgreSQL store: who leads (`leadership`), which replica serves which node
(`shards`), and the replica process that ties them to the API (`replicas`). Next: `controller/server.py` starts one."""
