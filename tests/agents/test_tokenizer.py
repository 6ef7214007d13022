"""ChatTokenizer on several chat-template styles: prompt + generated ids + observation ids decode to
exactly what the template renders for the whole conversation (no Qwen-only assumptions)."""
import pytest

from rolloutd.agents.engine.model_build import build_tiny_tokenizer
from rolloutd.agents.tokenizer import ChatTokenizer

CHATML_WITH_TOOL_ROLE = None  # the tiny model's own template

# Mistral style: no "tool" role (it raises on unknown roles), the turn closes with eos and nothing after
INST = ("{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}{{ '[INST] ' + m.content + ' [/INST]' }}"
        "{% elif m.role == 'assistant' %}{{ m.content + eos_token }}"
        "{% else %}{{ raise_exception('only user and assistant roles') }}{% endif %}{% endfor %}")
# Zephyr style: role headers, eos then a newline after each turn
ZEPHYR = ("{% for m in messages %}{{ '<|' + m.role + '|>\\n' + m.content + eos_token + '\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    build_tiny_tokenizer(out)
    return out


def make(tiny_dir, template):
    tok = ChatTokenizer(tiny_dir)
    if template is not None:
        tok.hf.chat_template = template
        tok.template = template
        tok.observation_role = "tool" if "tool" in template else "user"
        tok.__dict__.pop("_turn_closing", None)
    return tok


@pytest.mark.parametrize("template,role", [(CHATML_WITH_TOOL_ROLE, "tool"), (INST, "user"), (ZEPHYR, "user")],
                         ids=["chatml", "inst", "zephyr"])
@pytest.mark.parametrize("closed", [True, False], ids=["eos", "no-eos"])
def test_incremental_ids_equal_the_template_rendering(tiny_dir, template, role, closed):
    tok = make(tiny_dir, template)
    assert tok.observation_role == role
    eos = min(tok.eos_token_ids)
    messages = [{"role": "user", "content": "List files, then answer."}]
    ids = tok.encode_chat(messages)
    conversation = list(messages)
    for reply in ("```bash\nls\n```", "```bash\ncat a.txt\n```"):
        generated = tok.encode_text(reply) + ([eos] if closed else [])
        ids += generated
        conversation.append({"role": "assistant", "content": reply})
        observation = f"output of {reply.splitlines()[1]}"
        ids += tok.encode_observation(observation, closed=closed)
        conversation.append({"role": tok.observation_role, "content": observation})
    assert tok.decode(ids) == tok.render(conversation, add_generation_prompt=True)


def test_templates_that_rewrite_history_are_refused(tiny_dir):
    # renders only the last assistant message: appending a message changes earlier text
    tok = make(tiny_dir, "{% for m in messages %}{% if m.role != 'assistant' or loop.last %}"
                         "{{ m.role + ': ' + m.content + eos_token }}{% endif %}{% endfor %}")
    with pytest.raises(ValueError, match="re-renders earlier turns"):
        tok.encode_observation("x")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["HuggingFaceTB/SmolLM2-135M-Instruct", "no-such-model"])
def test_a_tokenizer_loads_offline_only_and_a_missing_one_says_so(tmp_path, name, monkeypatch):
    """A model hub name (or a directory that is not there) never reaches for the hub: it used to try five times
    (~50 s) and fail with "couldn't connect to huggingface.co". The daemon turns this into a config error naming
    spec.llm.tokenizer (tests/agents/daemon/test_daemon.py)."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="no such tokenizer directory on this node .*offline only"):
        ChatTokenizer(name)


# Qwen3 style: `enable_thinking=false` closes an empty think block in the generation prompt
THINKING = ("{% for m in messages %}{{ '<|' + m.role + '|>\\n' + m.content + eos_token + '\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}"
            "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
            "{% endif %}{% endif %}")


def test_the_jobs_chat_template_variables_reach_every_rendering(tiny_dir):
    """`spec.agent.chatTemplateKwargs` (the daemon passes them as `template_kwargs`): in the prompt's ids and in
    the observation's (which are rendered by the same template), validated in the spec."""
    from pydantic import ValidationError

    from rolloutd.crds.agent_spec import AgentSpec

    plain, off = make(tiny_dir, THINKING), make(tiny_dir, THINKING)
    off.template_kwargs = AgentSpec.model_validate({"chatTemplateKwargs": {"enable_thinking": False}}
                                                   ).chat_template_kwargs
    messages = [{"role": "user", "content": "2+2?"}]
    assert "<think>" not in plain.decode(plain.encode_chat(messages))
    assert off.decode(off.encode_chat(messages)).endswith("<|assistant|>\n<think>\n\n</think>\n\n")
    # the next turn's generation prompt, after a tool's observation, is rendered with them too
    assert off.decode(off.encode_observation("4", closed=True)).endswith("<|assistant|>\n<think>\n\n</think>\n\n")
    assert "<think>" not in plain.decode(plain.encode_observation("4", closed=True))
    for bad, says in (({"tokenize": True}, "set by rolloutd"), ({"x": [1]}, "string, a number or a boolean"),
                      ({"not a name": 1}, "string, a number or a boolean")):
        with pytest.raises(ValidationError, match=says) as e:
            AgentSpec.model_validate({"chatTemplateKwargs": bad})
        assert e.value.errors()[0]["loc"] == ("chatTemplateKwargs",)
