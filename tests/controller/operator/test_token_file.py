"""A token file is read again when it changes: a pod's service-account token (kubelet rewrites it before it
expires) and a kubeconfig's `tokenFile` reach every client the operator holds — its own writes (`JobApi`),
kopf's session (made at each login) and the kubernetes executor's client. The live rotation against a real
API server and kopf: tests/e2e/test_operator.py."""
from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest
import yaml

from rolloutd.controller.executors.kubernetes.clients import api_client_for
from rolloutd.controller.operator.kubeapi import BearerAuth, Connection

POD_ENV = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}


def rotate(path: Path, token: str) -> None:
    tmp = path.with_name(path.name + ".new")
    tmp.write_text(token + "\n")
    os.replace(tmp, path)


@pytest.fixture
def account(tmp_path):
    d = tmp_path / "serviceaccount"
    d.mkdir()
    (d / "token").write_text("token-1\n")
    return d


def sent(conn: Connection) -> str:
    request = httpx.Request("GET", "https://api.invalid/apis")
    return next(BearerAuth(conn).auth_flow(request)).headers["Authorization"]


def test_a_pods_rotated_token_is_sent_by_every_client(account):
    conn = Connection.in_cluster(account, POD_ENV)
    kube_client = api_client_for(conn.server, conn.bearer, conn.ca_path)().configuration
    assert conn.headers()["Authorization"] == sent(conn) == "Bearer token-1"
    assert kube_client.get_api_key_with_prefix("authorization") == "Bearer token-1"

    rotate(account / "token", "token-2")
    assert conn.headers()["Authorization"] == sent(conn) == "Bearer token-2"
    assert kube_client.get_api_key_with_prefix("authorization") == "Bearer token-2"

    (account / "token").unlink()  # mid-swap, or gone: the last token read, not none
    assert conn.bearer() == "token-2"


def test_a_kubeconfig_token_file_is_followed_and_a_literal_token_is_not_replaced(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("file-1\n")
    doc = {"current-context": "c", "clusters": [{"name": "k", "cluster": {"server": "https://k:6443/"}}],
           "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
           "users": [{"name": "u", "user": {"tokenFile": str(token_file)}}]}
    (tmp_path / "kubeconfig").write_text(yaml.safe_dump(doc))
    conn = Connection.from_kubeconfig(tmp_path / "kubeconfig")
    assert (conn.server, conn.bearer()) == ("https://k:6443", "file-1")
    rotate(token_file, "file-2")
    assert conn.bearer() == "file-2"

    doc["users"][0]["user"] = {"token": "literal", "tokenFile": str(token_file)}  # kubectl: the token wins
    (tmp_path / "kubeconfig").write_text(yaml.safe_dump(doc))
    literal = Connection.from_kubeconfig(tmp_path / "kubeconfig")
    assert (literal.token_file, literal.bearer()) == (None, "literal")
    assert api_client_for("https://k", "fixed")().configuration.get_api_key_with_prefix("authorization") == "Bearer fixed"
