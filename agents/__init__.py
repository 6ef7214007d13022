"""The node daemon side: INIT/RUN/EVAL pipeline, agent loop, task handlers, LLM client."""
