"""The inference engine on a node: its venv, the vLLM server it runs, the model directories it serves.

Used by `rolloutd agents` (agents/cli.py) and the node daemon; the next step is server.py (EngineServer).
"""
