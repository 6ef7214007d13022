"""SkyRL trains through rolloutd: `RolloutdGenerator` is a SkyRL `GeneratorInterface` whose batches a rolloutd
batch job runs.

    pip install 'rolloutd[skyrl]'    # skyrl + torch, in the trainer's own venv (`make skyrl-venv`)

See docs "Training with SkyRL". `generator.py` imports skyrl.
"""
from __future__ import annotations

from typing import Any

__all__ = ["RolloutdGenerator", "to_generator_output"]


def __getattr__(name: str) -> Any:  # skyrl (torch) only when asked for
    if name in __all__:
        from . import generator

        return getattr(generator, name)
    raise AttributeError(name)
