"""The image builder: `rolloutd image build` turns a Dockerfile into a root filesystem a sandbox runs on (build.py),
step by step in a bounded sandbox (build_step.py, build_limits.py), from a cached Debian base (rootfs.py).
The next step is build.py (`build_image`); cli.py is its command.
"""
