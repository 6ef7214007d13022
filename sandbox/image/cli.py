"""`rolloutd image build DIR`: build (or find cached) the root filesystem of a Dockerfile.

Where it sits: the ``image`` sub-command of ``rolloutd``, attached by `cli.register` (an entry point);
the work is `image_build.build_image`. Prints the rootfs path on
stdout (for ``sandbox.image``), notes and progress on stderr::

    rolloutd image build examples/harbor/tasks/csv-total
    rolloutd sandbox exec --image "$(rolloutd image build DIR)" -- python --version
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

import typer

app = typer.Typer(no_args_is_help=True)


@app.callback()
def _group() -> None:
    """Root filesystem images built from Dockerfiles (for bwrap's sandbox.image)."""


@app.command()
def build(
    directory: Path = typer.Argument(..., help="a Harbor task directory (environment/Dockerfile) or a build context"),
    cache_dir: Optional[Path] = typer.Option(None, "--cache-dir", help="image cache [default: $ROLLOUTD_IMAGE_DIR "
                                             "or ~/.cache/rolloutd/images]; a shared filesystem path builds once per cluster"),
    build_arg: List[str] = typer.Option([], "--build-arg", help="KEY=VALUE, as docker build --build-arg"),
    timeout: Optional[float] = typer.Option(None, "--timeout", help="seconds per step"),
    max_size_mb: Optional[int] = typer.Option(None, "--max-size-mb", help="the image's size bound, base included "
                                              "[default: $ROLLOUTD_IMAGE_MAX_MB or 8192]"),
) -> None:
    """Build DIR's Dockerfile into a root filesystem; print its path."""
    from rolloutd.crds.kit.settings import SandboxSettings, SettingsError
    from .dockerfile import DockerfileError
    from .build import build_image
    from .rootfs import ImageBuildError

    args = {}
    for item in build_arg:
        key, eq, value = item.partition("=")
        if not eq:
            raise typer.BadParameter(f"--build-arg {item!r}: expected KEY=VALUE")
        args[key] = value

    def log(message: str) -> None:
        typer.echo(message, err=True)

    try:
        settings = SandboxSettings.from_env()  # this command's entry point: the variables are read here, once
        image = build_image(directory, cache=cache_dir, build_args=args, timeout=timeout, log=log, max_mb=max_size_mb,
                            settings=settings)
    except (SettingsError, DockerfileError, ImageBuildError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    for note in image.notes:
        log(f"note: {note}")
    log(f"image {image.key}: {'cached' if image.cached else f'built in {image.seconds:.1f}s'}")
    typer.echo(str(image.rootfs))
    sys.stdout.flush()
