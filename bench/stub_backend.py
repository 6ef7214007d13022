"""An instant LLM backend for overhead benchmarks: speaks the slice of vLLM's OpenAI-compatible
API the node daemons use (/health, /v1/models, /v1/completions with token ids, also `stream: true`,
one chunk per token `--token-ms` apart) and answers every request at once with the same short reply. Only for measuring *our* overhead
(bench_pipeline.py) — never a stand-in for the engine in a test of behaviour.

    python -m bench.stub_backend --port 8100 --tokenizer DIR [--latency-ms 250] [--token-ms 5]
"""
from __future__ import annotations

import argparse
import asyncio

import uvicorn
import json

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse


def create_app(reply_ids: list[int], latency: float = 0.0, token_time: float = 0.0) -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health():
        return {}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "stub", "object": "model", "max_model_len": 4096}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        if latency > 0:  # an I/O-bound backend: each completion takes this long, concurrently
            await asyncio.sleep(latency)
        n = min(len(reply_ids), int(body.get("max_tokens") or 16))
        ids = reply_ids[:n]
        if body.get("stream"):
            return StreamingResponse(_chunks(ids, body["prompt"], token_time), media_type="text/event-stream")
        return {
            "id": "cmpl-stub", "object": "text_completion", "model": "stub",
            "choices": [{"index": 0, "text": "", "finish_reason": "stop", "stop_reason": None,
                         "token_ids": ids, "prompt_token_ids": body["prompt"],
                         "logprobs": {"token_logprobs": [-0.1] * n, "tokens": [f"token_id:{i}" for i in ids],
                                      "top_logprobs": None, "text_offset": [0] * n}}],
            "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": n, "total_tokens": 0},
        }

    return app


async def _chunks(ids: list[int], prompt: list[int], token_time: float):
    """vLLM's streamed completion: one chunk per token (`token_time` apart), the prompt ids in the first."""
    for k, i in enumerate(ids):
        if token_time > 0:
            await asyncio.sleep(token_time)
        choice = {"index": 0, "text": "", "token_ids": [i], "finish_reason": "stop" if k == len(ids) - 1 else None,
                  "logprobs": {"token_logprobs": [-0.1], "tokens": [f"token_id:{i}"]},
                  **({"prompt_token_ids": prompt} if k == 0 else {})}
        yield f"data: {json.dumps({'id': 'cmpl-stub', 'object': 'text_completion', 'choices': [choice]})}\n\n"
    yield "data: [DONE]\n\n"


def reply_for(tokenizer_dir: str, text: str = "The answer is \\boxed{2}.") -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    return tok.encode(text, add_special_tokens=False) + ([tok.eos_token_id] if tok.eos_token_id is not None else [])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--latency-ms", type=float, default=0.0, help="answer each completion after this long")
    ap.add_argument("--token-ms", type=float, default=0.0, help="streamed: one token this long after the last")
    args = ap.parse_args()
    uvicorn.run(create_app(reply_for(args.tokenizer), args.latency_ms / 1000.0, args.token_ms / 1000.0), host="127.0.0.1", port=args.port,
                log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
