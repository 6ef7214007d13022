"""The `apptainer` runtime: Apptainer/Singularity ``.sif`` images, rootless.

Where it sits: `get_runtime("apptainer")`; the create template (`base.py`) calls the hooks of
`ApptainerRuntime` and starts the result.
"""
from __future__ import annotations

import shutil

from ...crds.rolloutjob import SandboxSpec
from ..errors import SandboxCreateError
from ..host.footprint import Layout
from ..host.hostview import check_mounts
from ..launch import LaunchConfig, runtime_paths, server_argv, server_env
from .base import CONTAINED, Launch, SandboxRuntime


def _binary() -> str | None:
    return shutil.which("apptainer") or shutil.which("singularity")


class ApptainerRuntime(SandboxRuntime):
    """Usable only where an ``apptainer``
    (or ``singularity``) binary exists; otherwise `create` raises
    `RuntimeUnavailable` with the reason (its tests skip with that reason). Neither
    is installable on Debian 12 from its archive or PyPI, so this runtime is not
    exercised on the project's own machines.

    The container runs ``apptainer exec --containall --cleanenv --no-privs`` with
    ``--net --network none``; ``spec.network`` is refused (Apptainer's only other
    unprivileged network is the node's own, loopback included; bwrap gives a fenced
    namespace of its own, `host/netns.py`). Apptainer itself runs the
    container as the caller, with no_new_privs and no capabilities; it has no
    seccomp file here, so the bwrap filter does not apply. The workspace is bound at
    /workspace and the control directory at /.rolloutd. The execution server runs
    with the host's Python, bound at its host paths (so the image needs a
    compatible glibc), exactly as for a bwrap root filesystem image.

    Why not spython: spython's ``Client.execute`` runs a command to completion
    and returns its output; the execution server is a long-lived process whose
    group the node must own and kill by id, so the command line is built here
    (spython's ``Client.instance`` would add a second process tree to track).
    """

    name = "apptainer"

    @classmethod
    def available(cls) -> str | None:
        if _binary() is None:
            return "neither apptainer nor singularity is installed on this machine"
        return None

    def check(self, spec: SandboxSpec) -> None:
        if not spec.image.endswith(".sif"):
            raise SandboxCreateError(f"the apptainer runtime needs a .sif image, not {spec.image!r}")
        if spec.network:
            raise SandboxCreateError("spec.sandbox.network: true needs the bwrap runtime (apptainer would give the "
                                     "sandbox the node's own network, its loopback included)")
        check_mounts(spec.mounts, self.settings)

    def launch(self, spec: SandboxSpec, layout: Layout, config: LaunchConfig, fds: tuple[int, ...]) -> Launch:
        argv = [_binary(), "exec", "--containall", "--cleanenv", "--no-privs", "--pwd", CONTAINED.workspace,
                "--net", "--network", "none"]  # always: `check` refuses spec.network
        argv += ["--bind", f"{layout.workspace}:{CONTAINED.workspace}", "--bind", f"{layout.ctl}:{CONTAINED.ctl}"]
        for path in runtime_paths():
            argv += ["--bind", f"{path}:{path}:ro"]
        for m in spec.mounts:
            argv += ["--bind", f"{m.host_path}:{m.inside}:{'ro' if m.read_only else 'rw'}"]
        for key, value in server_env(layout.id).items():  # the job's environment goes to the sessions only (launch.py)
            argv += ["--env", f"{key}={value}"]
        return Launch(argv=[*argv, spec.image, *server_argv(config)])
