"""The Kubernetes API surface of the controller: discovery, RolloutJob verbs, watch, patch, Table, OpenAPI.

Mounted by `controller/api.py` (`create_app`); reads and writes through `controller/store/`.
Next step: kopf handlers (issue 13 §2) talking to exactly these routes.
"""
