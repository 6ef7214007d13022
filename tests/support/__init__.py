"""The helpers the test folders share: real processes started the way the tests need them (a controller,
an https controller, an e2e cluster, a Slurm-backed cluster, vLLM engines), stand-ins of the other side of a
protocol (a fake controller for the node daemon, a fake API server, a stub LLM, fake agents), and small
tools (waiting on a condition, the example job with its paths resolved).

Imported by name (`from support.waiting import wait_until`): pyproject's pytest settings put tests/ on
sys.path. Nothing here is a test; nothing here imports bench/ (tests/test_structure.py). `support.sim`
(the simulated surroundings: Slurm on one machine, simulated nodes, the no-op task kind) is the one package
bench/ imports too. Next step: one start-up wait for the three controller starters."""
