"""The domain-free kit beside the resources: settings and paths, safe reads of tenant data, waits, traces, plug-ins,
YAML documents and the docs' reference generator. Imported by every part; the next step is each module's own
docstring (settings.py first: every `ROLLOUTD_*` variable in one table).
"""
