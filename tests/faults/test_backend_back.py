"""A node's LLM client recovers when its backend comes back: more refused calls than its pool has connection slots
(a backend down for minutes while rollouts keep asking), then the backend is back on the same port and the next
`/health` poll and generation succeed at once (before: every slot leaked on a refused connect, and each later call
waited for a slot until the rollout's runSeconds ran out). Real HTTP on loopback: `VLLMBackend` and its keep-alive
pool against the stand-in backend of support/stub_llm.py."""
from __future__ import annotations

import asyncio

import pytest

from rolloutd.agents.llm import BackendError, SamplingParams
from rolloutd.agents.vllm_backend import VLLMBackend
from support.stub_llm import StubLLM

POOL_SLOTS = 256  # VLLMBackend's keep-alive pool


def test_generations_and_health_polls_succeed_once_the_backend_is_back():
    stub = StubLLM()
    port = stub.server.server_address[1]
    stub.close()  # the backend is down

    async def scenario():
        llm = VLLMBackend(f"http://127.0.0.1:{port}", connect_timeout=1.0, timeout=30.0)
        try:
            for i in range(POOL_SLOTS + 20):
                with pytest.raises(BackendError) as refused:
                    await llm.generate([1, 2, 3], SamplingParams(max_tokens=1), f"r{i}")
                assert refused.value.unreachable
            back = StubLLM(port)
            try:
                assert await asyncio.wait_for(llm.wait_healthy(5.0, every=0.1), 10)
                got = await asyncio.wait_for(llm.generate([1, 2, 3], SamplingParams(max_tokens=1), "after"), 10)
                assert got.token_ids == [2]
            finally:
                back.close()
        finally:
            await llm.aclose()

    asyncio.run(scenario())
