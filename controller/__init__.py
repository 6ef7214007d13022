"""The controller: API, SQLite store, reconcile loop, scheduler, executors. One per cluster."""
