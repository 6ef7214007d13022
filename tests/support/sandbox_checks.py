"""What the sandbox tests ask of the host: is bwrap installed (else the test is skipped with the reason), which
host processes carry a sandbox's id, are we root. Used by tests/sandbox and its subfolders. Next step: the
same skip for apptainer."""
from __future__ import annotations

import os
import shutil

import pytest


def require_bwrap() -> None:
    if shutil.which("bwrap") is None:
        pytest.skip("bwrap is not installed (bash .ci/system-packages.sh installs it)")


def host_pids_of(sandbox_id: str) -> list[int]:
    from rolloutd.sandbox.host.footprint import pids_with_id

    return pids_with_id(sandbox_id)


def is_root() -> bool:
    return os.geteuid() == 0
