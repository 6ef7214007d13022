"""The harness gateway: a rollout's OpenAI/Anthropic-compatible endpoint, its recorded calls, the verifier's egress.

Used by the harness task runner (agents/tasks/harness.py); the next step is server.py (`Gateway`), then the
dialects in agents/wire/.
"""
