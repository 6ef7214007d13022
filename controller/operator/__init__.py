"""The operator: kopf handlers (`handlers.py`) drive the per-job reconcile (`reconcile.py`) against the
controller's own Kubernetes API or another API server (`embedded.py`, `kubeapi.py`, `mirror.py`)."""
