"""The in-sandbox execution server (stdlib only; jupyter_client on the first IPython cell).

Where it sits: started inside every sandbox as a bare ``server`` package (see
`main.py`); the node side never imports it except in tests. It must not import
anything from ``rolloutd``: it runs before, and apart from, the rest of the code.
"""
