"""The verifier's way out: the sandbox layer's filtering egress proxy (sandbox/host/egress.py), named here for the node side.

Where it sits: the harbor handler's EVAL (agents/tasks/harbor.py) starts an `EgressProxy` in the sandbox's
control directory when the job consents (`sandbox.verifierNetwork`) and the task allows the internet, after
every process the agent left has been killed; the gateway's relay (agents/gateway/server.py `start_relay`) serves it
on the sandbox's own loopback and the verifier's shell gets `http_proxy`/`https_proxy`. It stops with the
verifier: the agent never has it. Next step: the verifier's downloads (uv, pip) reach public hosts only; the
proxy refuses loopback, private, link-local and metadata addresses and the node's own (image builds use the same proxy).
"""
from __future__ import annotations

from rolloutd.sandbox.host.egress import EgressProxy

__all__ = ["EgressProxy"]
