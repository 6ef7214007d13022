"""The in-sandbox execution server (stdlib only; its IPython kernel, `ipyrunner`, is a process of its own).

Where it sits: started inside every sandbox as a bare ``server`` package by the launcher in
`rolloutd.sandbox.launch`; `main.py` is its entry. It must not import anything from ``rolloutd``: it
runs before, and apart from, the rest of the code. The node side imports only `procs.py` (the one
/proc reader and kill loop, stdlib only so that both sides share it) and, in tests and benches, `first_bash.py`.
"""
