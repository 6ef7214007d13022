"""A stand-in LLM backend for tests whose subject is not the model (tests/tenancy, tests/slurm credentials):
just enough of vLLM's OpenAI API for the daemon (/health, /v1/models, /v1/completions with token ids, streamed
or not), every completion one token. It lets a real job run end to end without starting the engine."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class _StubBackend(BaseHTTPRequestHandler):
    """Just enough of vLLM's OpenAI API for one short turn: every completion is one token."""

    def _send(self, doc: dict) -> None:
        body = json.dumps(doc).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _absent(self) -> None:
        """What an engine says of a route it does not serve (the daemon probes for the token endpoints)."""
        self.send_error(404)

    def do_GET(self) -> None:  # noqa: N802
        if self.path.startswith("/v1/models"):
            return self._send({"data": [{"id": "stub", "max_model_len": 4096}]})
        return self._send({}) if self.path.startswith("/health") else self._absent()

    def do_POST(self) -> None:  # noqa: N802
        req = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        if self.path != "/v1/completions":
            return self._absent()
        doc = {"choices": [{"token_ids": [2], "logprobs": {"token_logprobs": [-0.5]}, "finish_reason": "stop",
                            "prompt_token_ids": req.get("prompt")}]}
        if not req.get("stream"):
            return self._send(doc)
        body = f"data: {json.dumps(doc)}\n\ndata: [DONE]\n\n".encode()  # the node streams where it can
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


class StubLLM:
    """The stub on a free loopback port, served from a thread until `close`."""

    def __init__(self, port: int = 0) -> None:  # a port: the same backend back after an outage
        self.server = ThreadingHTTPServer(("127.0.0.1", port), _StubBackend)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
