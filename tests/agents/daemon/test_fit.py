"""The job's tokenizer checked against its engine at a node's INIT (agents/daemon/fit.py): another model's tokenizer
fails the job once, as configuration naming spec.llm.tokenizer, before any rollout; the served model's passes."""
from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rolloutd.agents.daemon.daemon import NodeDaemon
from rolloutd.agents.daemon.fit import PROBE, misfit
from rolloutd.agents.daemon.supervise import EXIT_REFUSED
from rolloutd.agents.engine.model_dirs import is_ready, model_dir
from rolloutd.agents.tokenizer import ChatTokenizer
from rolloutd.crds.trajectory import Trajectory
from support.node_helpers import make_spec, options, tiny_dir
from support.scripted_tasks import ScriptedTask


def smollm2_dir():
    if not is_ready("smollm2"):
        pytest.skip("the smollm2 model is not prepared (rolloutd serve-model --prepare-only -m smollm2)")
    return model_dir("smollm2")


class _Engine(BaseHTTPRequestHandler):
    """`/tokenize` as vLLM answers it, with the ids of the tokenizer the server holds; anything else 404."""

    tokens: list[int] | None = None

    def do_POST(self):  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        ok = self.path == "/tokenize" and self.tokens is not None and body["prompt"] == PROBE
        data = json.dumps({"tokens": self.tokens, "count": len(self.tokens or [])} if ok else {"detail": "Not Found"})
        self.send_response(200 if ok else 404)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data.encode())

    def log_message(self, *args):
        pass


def _serving(tokens: list[int] | None) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer(("127.0.0.1", 0), type("Engine", (_Engine,), {"tokens": tokens}))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_the_check_compares_ids_and_passes_when_the_engine_cannot_tell():
    tiny, smol = ChatTokenizer(tiny_dir()), ChatTokenizer(smollm2_dir())
    for tokens, fits in ((tiny.encode_text(PROBE), True), (smol.encode_text(PROBE), False), (None, True)):
        server = _serving(tokens)
        try:
            reason = asyncio.run(misfit(tiny, str(tiny_dir()), f"http://127.0.0.1:{server.server_port}", None))
        finally:
            server.shutdown()
        assert (reason is None) == fits, reason
        if not fits:
            assert reason.startswith(f"spec.llm.tokenizer: {tiny_dir()} is not the tokenizer of the model served")
    assert asyncio.run(misfit(tiny, "t", "http://127.0.0.1:9", None)) is None  # unreachable: the backend checks say so


def test_the_served_models_tokenizer_fits_the_real_engine(tiny_engine):
    assert asyncio.run(misfit(ChatTokenizer(tiny_dir()), str(tiny_dir()), tiny_engine.url, None)) is None


def test_another_models_tokenizer_fails_the_job_once_at_init_against_the_real_engine(controller, tiny_engine):
    """The tiny model served, SmolLM2's tokenizer in the job: one leased rollout reports the reason unscored (the
    controller fails the job on it), the daemon exits 2 (no restart helps), no rollout reached the engine."""
    smol = str(smollm2_dir())
    fake = controller(make_spec(llm={"tokenizer": smol, "backends": [{"url": tiny_engine.url}]}))
    fake.add({"id": "p0"}, {"id": "p1"}, {"id": "p2"})
    handler = ScriptedTask()
    d = NodeDaemon(options(fake), handler=handler)
    assert asyncio.run(asyncio.wait_for(d.run(), 120)) == EXIT_REFUSED
    [t] = [Trajectory.model_validate(w) for w in fake.accepted.values()]
    assert t.failure.kind.value == "config" and t.reward is None
    assert t.failure.reason.startswith(f"spec.llm.tokenizer: {smol} is not the tokenizer of the model served at "
                                       f"{tiny_engine.url}"), t.failure.reason
    assert len(fake.lease_log) == 1 and fake.deregistered == 1 and handler.ran == []
