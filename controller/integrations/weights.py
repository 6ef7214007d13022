"""Saving a torch policy for rolloutd's weight sync: one safetensors file with Hugging Face names,
which a backend's `reload_weights(weights_path=DIR)` reads (`announce_policy(weights_path=DIR)`).

Used by the TRL integration's callback (trl/sync.py) and the plain-torch example (examples/rl/grpo.py).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any


def save_weights(model: Any, out_dir: str | Path) -> Path:
    """The whole state dict as `DIR/model.safetensors`, written to a temporary name and renamed;
    tied weights (lm_head.weight == embed_tokens.weight) are stored once."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state, seen = {}, set()
    for name, t in model.state_dict().items():
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        state[name] = t.detach().contiguous()
    tmp = out / ".model.safetensors.tmp"
    save_file(state, str(tmp), metadata={"format": "pt"})
    tmp.rename(out / "model.safetensors")
    return out
