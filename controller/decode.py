"""A stored trajectory made readable: its conversation, its turns and a token view, decoded with the job's
own tokenizer (`spec.llm.tokenizer`, loaded offline, once per path).

Called by `ui/app.py` (the trajectory page's JSON) and `ctl/trajectory.py` (`rolloutctl trajectory`, which has the
job's spec and the trajectory from the API). The text is the model's: this module returns it as data, and the
page and the terminal print it as text, never as markup. Next step: a harness's raw vs rewritten requests.
"""
from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger("rolloutd.ui")
MAX_TOKENS = 8192  # the token view's length; a longer sequence is cut (the page says so)


@functools.lru_cache(maxsize=8)
def _load(path: str) -> Any:
    from transformers import AutoTokenizer  # heavy: only when a trajectory is shown

    return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)


def tokenizer(path: str | None) -> tuple[Any | None, str]:
    """The tokenizer at `path` (a local directory) and "" — or None and why not (a path the controller cannot
    load leaves the conversation readable from `messages`; the message names no file content)."""
    if not path:
        return None, "the job names no tokenizer (spec.llm.tokenizer)"
    problem = f"spec.llm.tokenizer {path!r} could not be loaded on the controller's host"  # one answer for every cause
    if not Path(path).is_dir():
        return None, problem
    try:
        return _load(path), ""
    except Exception as e:  # noqa: BLE001 - any loader error: show the page without the token view
        log.warning("tokenizer %s: %s: %s", path, type(e).__name__, e)
        return None, problem


def _text(tok: Any, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=False) if tok is not None and ids else ""


def _tokens(tok: Any, ids: list[int], mask: list[int], logprobs: list, start: int = 0,
            spans: list | None = None) -> dict[str, Any]:
    cut = ids[:MAX_TOKENS]
    pieces = tok.batch_decode([[i] for i in cut], skip_special_tokens=False) if tok is not None else [str(i) for i in cut]
    versions: dict[int, Any] = {}  # position → the policy version that sampled it (versionSpans)
    for span in spans or []:
        for k in range(max(span.get("start", 0), 0), min(span.get("end", 0), len(cut))):
            versions[k] = span.get("version")
    return {"tokens": [{"i": start + k, "id": t, "text": pieces[k], "mask": mask[k] if k < len(mask) else None,
                        "logprob": logprobs[k] if k < len(logprobs) else None,
                        **({"version": versions[k]} if k in versions else {})} for k, t in enumerate(cut)],
            "truncated": len(ids) > len(cut), "length": len(ids),
            "versions": list(dict.fromkeys(span.get("version") for span in spans or []))}


def _turns(tok: Any, ids: list[int], turns: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for n, t in enumerate(turns):
        gen = ids[t.get("generatedStart", 0):t.get("generatedEnd", 0)]
        obs_start, obs_end = t.get("observationStart"), t.get("observationEnd")
        obs = ids[obs_start:obs_end] if obs_start is not None and obs_end is not None else []
        out.append({"turn": n, "assistant": _text(tok, gen), "toolCalls": t.get("toolCalls") or [],
                    "observation": _text(tok, obs), "finishReason": t.get("finishReason"),
                    "modelSeconds": t.get("modelSeconds"), "firstTokenSeconds": t.get("firstTokenSeconds")})
    return out


def _sequence(tok: Any, seq: dict[str, Any]) -> dict[str, Any]:
    ids = seq.get("tokenIds") or []
    plen = seq.get("promptLength") or 0
    return {"prompt": _text(tok, ids[:plen]), "turns": _turns(tok, ids, seq.get("turns") or []),
            "tokenView": _tokens(tok, ids, seq.get("lossMask") or [], seq.get("logprobs") or [],
                                 spans=seq.get("versionSpans") or []),
            "promptLength": plen, "drift": seq.get("drift", False), "calls": seq.get("calls")}


def decode(trajectory: dict[str, Any], tokenizer_path: str | None) -> dict[str, Any]:
    """The page's view of one trajectory (wire form, camelCase) decoded with the tokenizer at `tokenizer_path`."""
    tok, problem = tokenizer(tokenizer_path)
    segments = trajectory.get("segments") or []
    sequences = [_sequence(tok, s) for s in segments] if segments else [_sequence(tok, trajectory)]
    messages = [{"role": str(m.get("role", "")), "content": _content(m.get("content")),
                 "toolCalls": m.get("tool_calls") or m.get("toolCalls") or []} for m in trajectory.get("messages") or []]
    return {"messages": messages, "sequences": sequences, "tokenizer": tokenizer_path, "tokenizerProblem": problem,
            "answer": (trajectory.get("rewardDetails") or {}).get("answer"),
            **{k: trajectory.get(k) for k in ("job", "prompt", "sample", "group", "taskId", "reward", "rewardDetails",
                                              "failure", "finishReason", "policyVersion", "policyVersions", "backend",
                                              "node", "attempt", "timings", "metrics")}}


def _content(content: Any) -> str:
    """A message's text: a string, or the text parts of a list of content parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(str(p.get("text", "")) if isinstance(p, dict) else str(p) for p in content)
    return "" if content is None else str(content)
