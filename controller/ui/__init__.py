"""The web UI served by the controller at /ui (same port, same tokens): jobs live, a job's stages and
failures, a trajectory decoded with the job's own tokenizer.

`app.create_ui` builds the sub-app `api.create_app` mounts; `session` authenticates (cookie or bearer, the
API's own tokens and scope rule), `stats` aggregates a job's trajectories server-side, `decode` renders one.
The pages are static files (`static/`) whose script fetches the JSON routes. Next step: throughput over time.
"""
