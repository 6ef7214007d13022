"""Does the job's tokenizer fit the model its engine serves? Asked once at a node's INIT (`daemon._set_up`), so that
another model's tokenizer fails the job as configuration naming `spec.llm.tokenizer`, before any rollout.

The engine's own tokenizer is the reference: a probe text tokenized by the engine (vLLM's `/tokenize`) and by the
job's tokenizer must give the same ids, as rollouts send ids the model reads as the engine's tokens (a tokenizer
of another model is refused only at its first out-of-vocabulary id, or never, and then trains on noise). An engine
without `/tokenize` or one not answering cannot tell: the check passes and the backend's own checks report it.
"""
from __future__ import annotations

from typing import Any

import httpx

from .options import NodeError

# words, digits, accents, CJK, code and whitespace: tokenizers of different models split these differently
PROBE = "The quick brown fox jumps over 13 lazy dogs: é, ü, ß, 你好.\n  def f(x): return x**2  # done"
TIMEOUT = 10.0  # seconds: an engine still loading is the backend checks' business, not this one's


async def misfit(tokenizer: Any, path: str, url: str, model: str | None, *,
                 client: httpx.AsyncClient | None = None) -> str | None:
    """Why `tokenizer` (a `ChatTokenizer` read from `path`) does not fit the engine at `url`, or None when it fits
    or the engine cannot tell."""
    ours = tokenizer.encode_text(PROBE)
    body = {"prompt": PROBE, "add_special_tokens": False, **({"model": model} if model else {})}
    own = client is None
    client = client or httpx.AsyncClient(timeout=TIMEOUT)
    try:
        r = await client.post(f"{url.rstrip('/')}/tokenize", json=body)
        theirs = r.json().get("tokens") if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    finally:
        if own:
            await client.aclose()
    if not isinstance(theirs, list) or theirs == ours:
        return None
    at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    shown = (lambda ids: ids[at] if at < len(ids) else "none")
    return (f"spec.llm.tokenizer: {path} is not the tokenizer of the model served at {url}"
            f"{f' ({model})' if model else ''}: a probe text is {len(ours)} tokens with it and {len(theirs)} in the "
            f"engine, the first different at position {at} (id {shown(ours)} against the engine's {shown(theirs)}); "
            f"this tokenizer has {tokenizer.vocab_size} ids. Give the directory of the served model's tokenizer")


async def check_fit(tokenizer: Any, spec: Any, url: str | None, job: str) -> None:
    """At a node's INIT: the loaded tokenizer against the engine of the job's first backend (`url`); a misfit is a
    `NodeError` the daemon reports once as the job's configuration error."""
    if tokenizer is None or url is None:
        return
    reason = await misfit(tokenizer, spec.llm.tokenizer, url, spec.llm.model)
    if reason:
        raise NodeError(f"cannot set up job {job!r}: {reason}", config=reason)
