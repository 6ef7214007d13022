"""`TaskHandler.run` end to end with a scripted LLM (the real agent loop and the tiny model's real
tokenizer, no engine): the answer the loop returns reaches `eval` through the trajectory, and for
code and swe the agent's tool calls act in a REAL bwrap sandbox that EVAL then scores."""
import asyncio
import json

import pytest

from rolloutd.agents.llm import Generation, SamplingParams
from rolloutd.agents.engine.model_build import build_tiny_tokenizer
from rolloutd.agents.tokenizer import ChatTokenizer
from rolloutd.agents.loop.rollout import AgentConfig, RolloutContext
from rolloutd.agents.tasks import get_handler

CTX = RolloutContext(job="j", prompt=0, sample=0, task_id="t")


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-tokenizer")
    build_tiny_tokenizer(out)
    return ChatTokenizer(out)


class ScriptedLLM:
    """Answers turn i with the ids of replies[i] + EOS; implements only `generate`."""

    def __init__(self, tok, replies):
        self.tok, self.replies = tok, list(replies)

    async def generate(self, prompt_ids, sampling, request_id):
        ids = self.tok.encode_text(self.replies.pop(0)) + [min(self.tok.eos_token_ids)]
        return Generation(ids, [-0.1] * len(ids), "stop", list(prompt_ids), 0)

    async def abort(self, request_id):
        pass


def call(name, **arguments):
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def config(tools, turns=4):
    return AgentConfig(max_turns=turns, max_tokens_per_turn=512, max_total_tokens=8192, tools=tools,
                       sampling=SamplingParams(seed=1))


def test_math_final_text_reaches_eval(tok):
    handler = get_handler("math")
    task = {"id": "m", "question": "What is 1/4 + 1/4?", "answer": "0.5"}

    async def main():
        traj = await handler.run(task, None, ScriptedLLM(tok, ["1/4 + 1/4 = \\boxed{\\frac{2}{4}}"]),
                                 tokenizer=tok, config=config([]), ctx=CTX)
        return traj, await handler.eval(task, None, traj)

    traj, reward = asyncio.run(main())
    assert traj.reward_details["final_text"].endswith("\\boxed{\\frac{2}{4}}")
    assert traj.reward_details["submitted"] is None
    assert reward.value == 1.0


def test_stem_submitted_answer_reaches_eval(tok):
    handler = get_handler("stem")
    task = {"id": "s", "question": "2 + 2?", "choices": ["3", "4"], "answer": "B"}

    async def main():
        traj = await handler.run(task, None, ScriptedLLM(tok, [call("submit", answer="B")]),
                                 tokenizer=tok, config=config(["submit"]), ctx=CTX)
        return traj, await handler.eval(task, None, traj)

    traj, reward = asyncio.run(main())
    assert traj.reward_details["submitted"] == "B" and reward.value == 1.0


def test_code_agent_writes_solution_in_the_sandbox(tok, sandboxes):
    handler = get_handler("code")
    row = handler.load("examples/code/train.jsonl", limit=1)[0]
    write = call("bash", command="printf 'def add(a, b):\\n    return a + b\\n' > solution.py")

    async def main():
        sb = await sandboxes.create()
        try:
            await handler.init(row, sb)
            traj = await handler.run(row, sb, ScriptedLLM(tok, [write, "Done."]),
                                     tokenizer=tok, config=config(["bash"]), ctx=CTX)
            return traj, await handler.eval(row, sb, traj)
        finally:
            await sb.close()

    traj, reward = asyncio.run(main())
    assert traj.failure.kind.value == "none", traj.failure
    assert reward.value == 1.0, reward.details


def test_swe_agent_fixes_the_repository(tok, sandboxes):
    handler = get_handler("swe", sandbox_factory=sandboxes.create)
    row = handler.load("examples/swe/train.jsonl", limit=1)[0]     # median() of an even-sized list
    fix = call("editor", command="str_replace", path="/workspace/repo/minilib/stats.py",
               old_str="        return ordered[mid]\n    return ordered[mid]\n",
               new_str="        return ordered[mid]\n    return (ordered[mid - 1] + ordered[mid]) / 2\n")

    async def main():
        sb = await sandboxes.create()
        try:
            await handler.init(row, sb)
            traj = await handler.run(row, sb, ScriptedLLM(tok, [fix, "Fixed."]),
                                     tokenizer=tok, config=config(["bash", "editor"]), ctx=CTX)
            return traj, await handler.eval(row, sb, traj)
        finally:
            await sb.close()

    traj, reward = asyncio.run(main())
    assert reward.value == 1.0, reward.details
    assert "+    return (ordered[mid - 1] + ordered[mid]) / 2" in reward.details["patch"]
