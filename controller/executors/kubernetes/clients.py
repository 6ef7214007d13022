"""The Kubernetes API client factories the executor is made with: the controller's own cluster (in a pod its
service account, elsewhere $KUBECONFIG) or one API server named by the operator's kubeconfig.

Called by `executor.KubernetesExecutor.from_site`; the executor calls a factory on first use and reaches the
cluster through the `kubernetes` client (the `[kubernetes]` extra, imported here only when a factory is called).
"""
from __future__ import annotations

from typing import Any, Callable


def default_api_client() -> Any:
    """In a pod: its service account; elsewhere: $KUBECONFIG / ~/.kube/config."""
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.ApiClient()


def api_client_for(server: str, token: Callable[[], str | None] | str | None = None, ca_path: str | None = None,
                   insecure: bool = False) -> Callable[[], Any]:
    """A client factory for one API server (operator mode: the one in `rolloutd operator --kubeconfig`).
    `token` may be a callable (`Connection.bearer`), asked before each request: a rotated token is picked up."""
    current = token if callable(token) else (lambda: token)

    def make() -> Any:
        from kubernetes import client

        conf = client.Configuration()
        conf.host = server
        first = current()
        if first:  # the client sends a token only when it holds one before the hook is asked for a newer one
            conf.api_key, conf.api_key_prefix = {"authorization": first}, {"authorization": "Bearer"}

            def refresh(c: Any) -> None:
                c.api_key = {"authorization": current() or c.api_key["authorization"]}
            conf.refresh_api_key_hook = refresh
        conf.ssl_ca_cert, conf.verify_ssl = ca_path, not insecure
        return client.ApiClient(conf)
    return make
