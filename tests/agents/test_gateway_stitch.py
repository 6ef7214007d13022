"""Token-exact whatever a harness does to its history (agents/gateway/server.py `stitch`, agents/tasks/harness.py):
scripted call sequences (a side call, a rewrite, a truncation, a compaction) give as few sequences as the
ids allow (PREFIX MERGE: a call extending ANY earlier sequence continues it), each call's generated run is a
turn of its own sequence, and the trajectory reports how many sequences and how many re-tokenized ids.
The last test drives a real gateway on a Unix socket with the real tiny tokenizer as a harness would (the
LLM is a double answering fixed ids; the real engine behind the gateway: test_gateway.py)."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx

from rolloutd.agents.gateway.server import Call, Gateway, stitch
from rolloutd.agents.llm import Generation, SamplingParams
from rolloutd.agents.engine.model_dirs import model_dir
from rolloutd.agents.loop.rollout import RolloutContext
from rolloutd.agents.tasks.harness import _trajectory
from rolloutd.agents.tokenizer import ChatTokenizer


def call(prompt, generated, finish="stop"):
    return Call(list(prompt), list(generated), [-0.5] * len(generated), finish)


def test_a_side_call_between_two_turns_does_not_split_the_main_sequence():
    """Claude Code and Codex make side calls (a title, a topic check) between their turns: the main
    history's next call continues the main sequence, so the trainer gets two sequences, not three."""
    main1 = call([1, 2, 3], [10, 11])
    side = call([7, 8], [20])                           # another system prompt: its own sequence
    main2 = call([1, 2, 3, 10, 11, 4], [12])            # back to the main history, extended
    main3 = call([1, 2, 3, 10, 11, 4, 12, 5], [13], "length")
    first, second = stitch([main1, side, main2, main3])
    assert first.token_ids == [1, 2, 3, 10, 11, 4, 12, 5, 13] and first.calls == 3
    assert first.loss_mask == [0, 0, 0, 1, 1, 0, 1, 0, 1]
    assert first.turns == [(3, 5, "stop"), (6, 7, "stop"), (8, 9, "length")]
    assert (second.token_ids, second.turns, second.retokenized) == ([7, 8, 20], [(2, 3, "stop")], 2)
    assert first.retokenized == 0


def test_the_longest_sequence_a_prompt_extends_is_continued():
    a = call([1, 2], [3])
    b = call([1, 2, 3, 4], [5])          # extends a
    c = call([1, 2, 9], [6])             # a rewrite of a's answer: new sequence, 2 ids shared
    d = call([1, 2, 9, 6, 7], [8])       # extends c only
    one, two = stitch([a, b, c, d])
    assert one.token_ids == [1, 2, 3, 4, 5] and two.token_ids == [1, 2, 9, 6, 7, 8]
    assert two.retokenized == 1 and two.calls == 2


def test_truncation_and_compaction_start_new_sequences_and_count_the_ids_sent_again():
    system, turn1, turn2 = [1, 2], [3, 4], [5, 6]
    calls = [call(system + turn1, [30, 31]),
             call(system + turn1 + [30, 31] + turn2, [32]),
             # truncation: the harness drops its oldest turn, keeps the system prompt and the rest as text
             call(system + [30, 31] + turn2 + [32, 7], [33]),
             # compaction: the history becomes a summary written by the harness
             call(system + [40, 41, 42], [34])]
    seqs = stitch(calls)
    assert [s.calls for s in seqs] == [2, 1, 1]
    assert seqs[1].retokenized == len(calls[2].prompt_ids) - 2  # only the system prompt is shared
    assert seqs[2].retokenized == 3
    for s in seqs:  # every generated id is where a turn says, with its logprob; nothing else is masked
        assert sum(e - b for b, e, _ in s.turns) == sum(s.loss_mask)
        assert all(s.logprobs[i] == -0.5 for b, e, _ in s.turns for i in range(b, e))


def test_drift_is_a_kept_text_with_other_ids():
    text = {(1, 2, 3, 4): "ab", (1, 2, 34): "ab!", (1, 2, 3, 4, 9): "abc"}
    _, drifted = stitch([call([1, 2], [3, 4]), call([1, 2, 34], [8])], decode=lambda ids: text[tuple(ids)])
    assert drifted.drift and drifted.retokenized == 1


class FixedLLM:
    """Each call answers the next scripted text's ids."""

    def __init__(self, tok, texts):
        self.ids = [tok.encode_text(t) for t in texts]

    async def generate(self, prompt_ids, sampling, request_id):
        ids = self.ids.pop(0)
        return Generation(ids, [-0.25] * len(ids), "stop", list(prompt_ids), None)


def test_a_harness_with_a_side_call_and_a_compaction_through_the_gateway(tmp_path):
    tok = ChatTokenizer(model_dir("tiny"))
    system = {"role": "system", "content": "You are a coding agent."}
    user = {"role": "user", "content": "count the words in words.txt"}
    answers = ["I will run wc.<|im_end|>", "title: counting<|im_end|>", "It has 12 words.<|im_end|>",
               "Done.<|im_end|>"]

    async def go():
        gateway = Gateway(FixedLLM(tok, answers), tok, SamplingParams(max_tokens=32))
        sock = tmp_path / "gw.sock"
        await gateway.start(sock)
        try:
            async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=str(sock)), base_url="http://gw",
                                         timeout=60) as client:
                async def chat(messages):
                    r = await client.post("/v1/chat/completions", json={"messages": messages})
                    return r.json()["choices"][0]["message"]
                history = [system, user]
                history.append(await chat(history))
                await chat([{"role": "user", "content": "Give this conversation a title."}])  # side call
                history.append({"role": "user", "content": "go on"})
                history.append(await chat(history))
                await chat([system, {"role": "user", "content": "Summary: wc said 12. Finish."}])  # compaction
        finally:
            await gateway.stop()
        return gateway

    gateway = asyncio.run(go())
    t = _trajectory(gateway, tok, RolloutContext(job="gw", prompt=0, sample=0), SimpleNamespace(timed_out=False, output=""))
    assert t.metrics["gateway_calls"] == 4 and t.metrics["segments"] == 3 and len(t.segments) == 3
    main, side, compacted = t.segments
    assert main.calls == 2 and [u.finish_reason for u in main.turns] == ["stop", "stop"]
    assert [tok.decode(main.token_ids[u.generated_start:u.generated_end]) for u in main.turns] == answers[::2][:2]
    shared = len(tok.encode_text(tok.render([system], add_generation_prompt=False)))
    assert compacted.prompt_length - shared <= t.metrics["retokenized_tokens"]
    assert t.metrics["retokenized_tokens"] == side.prompt_length - _common(side, main) + compacted.prompt_length - max(
        _common(compacted, main), _common(compacted, side))


def _common(a, b) -> int:
    n = 0
    while n < min(len(a.token_ids), len(b.token_ids)) and a.token_ids[n] == b.token_ids[n]:
        n += 1
    return n
