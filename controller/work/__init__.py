"""The controller's work core: datasets expanded into items, leased to node daemons, results fed to trainers.

`core.build_work` makes each part once; the composition root (`controller/root.py`) holds them and the routes call
the parts they use; `scheduler.Scheduler` keeps its own logic (admit, progress, forget, batches, the background loop).
"""
