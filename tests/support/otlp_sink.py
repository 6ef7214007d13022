"""A small OTLP/HTTP trace receiver in the test's process: it takes what the real OTLP exporters send to
`/v1/traces` (protobuf `ExportTraceServiceRequest`, gzip or not) and keeps each span's trace id, name and
attributes. For tests that need the spans' ids but not a tracking server (tests/support/otlp_receiver.py runs
MLflow, ~1-2 minutes to start on a loaded machine)."""
from __future__ import annotations

import gzip
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class OtlpSink:
    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                req = ExportTraceServiceRequest.FromString(body)
                got = [{"trace": s.trace_id.hex(), "name": s.name,
                        "attributes": {a.key: getattr(a.value, a.value.WhichOneof("value")) for a in s.attributes
                                       if a.value.WhichOneof("value")}}
                       for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans]
                with sink._lock:
                    sink.spans += got
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def env(self) -> dict[str, str]:
        """Tracing on, the standard OTLP variables pointed here."""
        return {"ROLLOUTD_TRACING": "1", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"{self.url}/v1/traces",
                "OTEL_BSP_SCHEDULE_DELAY": "200"}

    def stored(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self.spans)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
