"""The controller's HTTP edge: thin routes that parse a request, call the store or the scheduler, and
answer. `bodies` reads request bodies, `nodes` and `trainer` are the scheduler's routes, `openapi`
describes them all; `controller.api` builds the app and mounts these routers.
"""
