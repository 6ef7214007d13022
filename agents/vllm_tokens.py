"""vLLM's token endpoint (`POST /inference/v1/generate`, served with `--enable-scale-out`): integer ids in and out,
and on its answer (a stream's final chunk) the engine's own weight stamps (`weight_versions`: which labelled weights
made each token); and what any vLLM answer says beside its tokens: the reason in an error (`engine_message`), the
prompt tokens found in the prefix cache (`cached_tokens`).

`vllm_backend.VLLMBackend` uses it instead of `/v1/completions` for its streamed calls, and for the plain ones it is
asked to stamp, when the engine serves it and labels its weights (`stamps`, probed once); `daemon.llmgate.TrackedLLM`
turns the stamps into per-token policy versions.
"""
from __future__ import annotations

import json
import math
from collections.abc import Awaitable, Callable
from typing import Any

GENERATE = "/inference/v1/generate"
# served with it (the same switch), and answers without the engine core or an error in the engine's log: the probe
PROBE = "/v1/completions/render"


async def served(request: Callable[..., Awaitable[Any]], model: str | None) -> bool:
    """Whether the engine serves this endpoint (probed by rendering a 1-token prompt: 200; 403 when disabled, 404 when
    absent) and labels its weights (`/weight_info`); `request(method, path, json=, timeout=)` is the client's call."""
    r = await request("POST", PROBE, json={"model": model, "prompt": [0]}, timeout=30.0)
    return r.status_code == 200 and (await request("GET", "/weight_info", timeout=30.0)).status_code == 200


async def paused(request: Callable[..., Awaitable[Any]]) -> bool:
    """Whether the engine is paused now (vLLM's `/is_paused`, dev mode); False when it does not answer so."""
    try:
        return (await request("GET", "/is_paused", timeout=10.0)).json().get("is_paused") is True
    except Exception:  # noqa: BLE001 - the client's failure, a body that is not JSON: not paused as far as we know
        return False


def body(prompt_ids: list[int], fields: dict[str, Any], request_id: str, model: str,
         stream: bool = True) -> dict[str, Any]:
    """The request for `prompt_ids` with the sampling `fields` (`SamplingParams.request_fields()` with the clamped
    `max_tokens`), streamed or not, the sampled token's logprob for each id."""
    sampling = {k: v for k, v in fields.items() if k not in ("model", "prompt", "request_id")}
    sampling.update({"logprobs": 0, "skip_special_tokens": False})
    return {"model": model, "token_ids": list(prompt_ids), "sampling_params": sampling, "stream": stream,
            "request_id": request_id}


def engine_ids(request_id: str) -> list[str]:
    """The id the engine gives a request of this endpoint (vLLM 0.32: `generate-tokens-<id>`), for `/abort_requests`."""
    return [f"generate-tokens-{request_id}"]


def parse(chunk: dict[str, Any]) -> tuple[list[int], list[float], str, Any, list[tuple[str, int, int]] | None]:
    """One streamed chunk's choice: (ids, logprobs, finish reason ("" until the last), stop reason, the weight stamps
    over the whole output: [(label, start, end)], on the last chunk only). KeyError/TypeError/ValueError when it is
    not such a chunk."""
    choice = chunk["choices"][0]
    ids = [int(i) for i in choice.get("token_ids") or []]
    content = (choice.get("logprobs") or {}).get("content") or []
    if [int(c["token_id"]) for c in content] != ids:
        raise ValueError("logprob tokens do not match the generated ids")
    logprobs = [float(c["logprob"]) if c.get("logprob") is not None else -math.inf for c in content]
    stamps = choice.get("weight_versions")
    spans = None if stamps is None else [(str(s["version"]), int(s["start"]), int(s["end"])) for s in stamps]
    return ids, logprobs, choice.get("finish_reason") or "", choice.get("stop_reason"), spans


def engine_message(text: str, limit: int = 300) -> str:
    """The engine's own reason in an error answer (vLLM: `{"error": {"message": …}}` or `{"message": …}`)."""
    try:
        answer = json.loads(text)
    except ValueError:
        return text.strip()[:limit] or "(no body)"
    err = answer.get("error", answer) if isinstance(answer, dict) else answer
    message = err.get("message") if isinstance(err, dict) else None
    return str(message if message else text.strip())[:limit]


def cached_tokens(answer: dict[str, Any]) -> int | None:
    """The prompt tokens the engine found in its prefix cache (`usage.prompt_tokens_details.cached_tokens`); None
    where the answer does not say it as a count (any backend the job names may answer anything)."""
    usage = answer.get("usage") if isinstance(answer, dict) else None
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    n = details.get("cached_tokens") if isinstance(details, dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 0 else None
