"""A local HTTP double of kube-apiserver for the kubernetes executor's unit tests: batch/v1 Jobs and
core/v1 Secrets and Pods (and their logs) of one namespace, every request recorded, created Jobs validated strictly
against the Kubernetes schemas (422 like the real server). Used by test_kubernetes_executor.py."""
from __future__ import annotations

import json
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import kubernetes_validate

K8S_VERSION = "1.33"  # the oldest Kubernetes the chart supports (kubeVersion in Chart.yaml)


class FakeApiServer:
    """Answers like kube-apiserver for the calls the executor makes; validates created Jobs strictly."""

    def __init__(self):
        self.requests: list[dict] = []
        self.jobs: dict[tuple[str, str], dict] = {}
        self.secrets: dict[tuple[str, str], dict] = {}
        self.pods: list[dict] = []
        self.logs: dict[str, str] = {}  # pod name → its `node` container's log
        self.forbidden: set[str] = set()
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _reply(self, code, obj):
                text = isinstance(obj, str)  # a pod's log
                data = obj.encode() if text else json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "text/plain" if text else "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _handle(self):
                url = urlparse(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                with server.lock:
                    server.requests.append({"method": self.command, "path": url.path, "query": parse_qs(url.query),
                                            "contentType": self.headers.get("Content-Type"), "body": body,
                                            "authorization": self.headers.get("Authorization")})
                    code, obj = server.route(self.command, url.path, parse_qs(url.query),
                                             self.headers.get("Content-Type"), body)
                self._reply(code, obj)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _handle

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @staticmethod
    def status(code, reason, message):
        return code, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message,
                      "reason": reason, "code": code}

    def route(self, method, path, query, ctype, body):
        parts = path.strip("/").split("/")
        # /apis/batch/v1/namespaces/NS/jobs[/NAME] or /api/v1/namespaces/NS/secrets|pods[/NAME]
        core = parts[0] == "api"
        ns, kind = parts[3 if core else 4], parts[4 if core else 5]
        name = parts[5 if core else 6] if len(parts) > (5 if core else 6) else None
        if ns in self.forbidden:
            return self.status(403, "Forbidden", f'{kind} is forbidden: User "system:serviceaccount:rolloutd:rolloutd" '
                                                 f'cannot {method.lower()} resource "{kind}" in the namespace "{ns}"')
        if kind == "pods" and parts[-1] == "log":  # …/pods/NAME/log?container=&tailLines=
            if name not in self.logs:
                return self.status(404, "NotFound", f'pods "{name}" not found')
            tail = int(query.get("tailLines", ["0"])[0])
            return 200, "".join(line + "\n" for line in self.logs[name].splitlines()[-tail:] if tail)
        if kind == "pods":
            selector = dict(kv.split("=", 1) for kv in query.get("labelSelector", [""])[0].split(",") if kv)
            items = [p for p in self.pods if all(p["metadata"]["labels"].get(k) == v for k, v in selector.items())]
            return 200, {"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": items}
        store = self.jobs if kind == "jobs" else self.secrets
        if method == "POST":
            key = (ns, body["metadata"]["name"])
            if key in store:
                return self.status(409, "AlreadyExists", f'{kind} "{key[1]}" already exists')
            if kind == "jobs":
                try:
                    kubernetes_validate.validate(body, K8S_VERSION, strict=True)
                except kubernetes_validate.ValidationError as e:
                    return self.status(422, "Invalid", str(e).splitlines()[0])
            obj = json.loads(json.dumps(body))
            obj["metadata"].update(uid=str(uuid.uuid4()), creationTimestamp="2026-11-23T07:00:00Z")
            store[key] = obj
            return 201, obj
        key = (ns, name)
        if key not in store:
            return self.status(404, "NotFound", f'{kind} "{name}" not found')
        if method == "GET":
            return 200, store[key]
        if method == "PUT":
            store[key] = {**body, "metadata": {**store[key]["metadata"], **body["metadata"]}}
            return 200, store[key]
        if method == "PATCH":
            if ctype not in ("application/merge-patch+json", "application/strategic-merge-patch+json"):
                return 415, {"kind": "Status", "code": 415, "message": f"unsupported patch type {ctype}"}
            store[key]["spec"].update(body["spec"])
            return 200, store[key]
        if method == "DELETE":
            del store[key]
            return 200, {"kind": "Status", "apiVersion": "v1", "status": "Success"}
        return self.status(405, "MethodNotAllowed", method)

    def calls(self) -> list[tuple[str, str]]:
        with self.lock:
            out = [(r["method"], r["path"]) for r in self.requests]
            self.requests.clear()
        return out

    def add_pod(self, job_name, index, phase):
        self.pods.append({"apiVersion": "v1", "kind": "Pod",
                          "metadata": {"name": f"{job_name}-{index}-x", "namespace": "rl",
                                       "labels": {"batch.kubernetes.io/job-name": job_name},
                                       "annotations": {"batch.kubernetes.io/job-completion-index": str(index)},
                                       "creationTimestamp": "2026-11-23T07:00:01Z"},
                          "spec": {"containers": [{"name": "node", "image": "img"}]},
                          "status": {"phase": phase}})
