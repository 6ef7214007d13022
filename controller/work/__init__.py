"""The controller's work core: datasets expanded into items, leased to node daemons, results fed to trainers.

`scheduler.Scheduler` composes the parts; the routes, the reconciler and the server call only it.
"""
