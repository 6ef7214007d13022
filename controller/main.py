"""The `rolloutd` command: the daemons and operator tools.

`rolloutd controller` runs the controller (`server.run_controller`), `rolloutd operator` its kopf handlers
against another API server; the other parts contribute their own sub-commands (`sandbox`, `image`,
`serve-model`, `node`) through the `rolloutd.commands` entry points (pyproject.toml), so each part keeps its
CLI next to its code and the controller imports none of them.
"""
from __future__ import annotations

from importlib.metadata import entry_points
from pathlib import Path

import typer

from .cli_common import TYPER_SETTINGS, version_option
from rolloutd.crds.kit.paths import DEFAULT_HOST, DEFAULT_PORT

app = typer.Typer(
    help="rolloutd: Rollout-as-a-Service operator for Slurm (daemons and operator tools).",
    no_args_is_help=True,
    **TYPER_SETTINGS,
)


@app.callback()
def _global(_version: bool = version_option()) -> None:
    pass



for _part in sorted(entry_points(group="rolloutd.commands"), key=lambda e: e.name):
    _part.load()(app)  # each part's `register(app)` adds its sub-commands
token_app = typer.Typer(help="Scoped API tokens (read-only, limited to namespaces).", no_args_is_help=True,
                        rich_markup_mode=None)
app.add_typer(token_app, name="token")


@app.command()
def controller(
    data_dir: Path = typer.Option(None, help="database and token live here [default: $ROLLOUTD_DATA_DIR or ~/.local/share/rolloutd]"),
    host: str = typer.Option(DEFAULT_HOST, help="address to listen on"),
    port: int = typer.Option(DEFAULT_PORT, help="TCP port of the API"),
    log_level: str = typer.Option("info"),
    executors: str = typer.Option("local,slurm", help="comma-separated executor kinds this controller runs ('' for none)"),
    tls_cert_file: Path = typer.Option(None, help="serve HTTPS with this certificate (kubectl sends tokens over TLS only)"),
    tls_key_file: Path = typer.Option(None, help="the certificate's private key"),
    tls_ca_file: Path = typer.Option(None, exists=True, dir_okay=False,
                                     help="the CA that signed the certificate, for the node daemons this controller "
                                          "starts (their ROLLOUTD_CA_FILE) [default: the certificate: self-signed]"),
    operator: bool = typer.Option(True, help="reconcile this controller's RolloutJobs with the embedded kopf "
                                             "operator (--no-operator: another one does, `rolloutd operator`)"),
    keep_daemons: bool = typer.Option(False, "--keep-daemons", help="on SIGTERM leave the local node daemons "
                                      "running for a restarted controller to adopt (default: release them; a "
                                      "killed controller always leaves them)"),
    store: str = typer.Option(None, help="an SQLite file, or a postgresql://user:password@host/database URL "
                                         "[default: $ROLLOUTD_STORE, else the data dir's rolloutd.db]"),
) -> None:
    """Run the controller: API, store (SQLite, or PostgreSQL), scheduler and the kopf operator."""
    from .server import run_controller

    if (tls_cert_file is None) != (tls_key_file is None):
        raise typer.BadParameter("--tls-cert-file and --tls-key-file go together")
    if tls_ca_file and not tls_cert_file:
        raise typer.BadParameter("--tls-ca-file needs --tls-cert-file and --tls-key-file")
    settings = _settings(store)
    run_controller(data_dir or settings.data_dir, host, port, log_level, _kinds(executors),
                   tls=(tls_cert_file, tls_key_file) if tls_cert_file else None, operator=operator,
                   ca_file=tls_ca_file, keep_daemons=keep_daemons, settings=settings)


@app.command()
def operator(
    kubeconfig: Path = typer.Option(None, exists=True, dir_okay=False,
                                    help="the API server whose RolloutJobs to reconcile [default in a pod: its "
                                         "cluster, through the pod's service account]"),
    context: str = typer.Option(None, help="kubeconfig context [default: its current-context]"),
    data_dir: Path = typer.Option(None, help="SQLite for work items and trajectories, tokens [default: as controller]"),
    host: str = typer.Option(DEFAULT_HOST, help="address of the scheduler and trainer API (node daemons, trainers)"),
    port: int = typer.Option(DEFAULT_PORT, help="TCP port of that API"),
    log_level: str = typer.Option("info"),
    executors: str = typer.Option("local,slurm", help="comma-separated executor kinds this operator runs"),
    store: str = typer.Option(None, help="as `rolloutd controller --store` [default: $ROLLOUTD_STORE, else the "
                                         "data dir's rolloutd.db]"),
) -> None:
    """Run the kopf operator against another API server (a cluster, or a `rolloutd controller --no-operator`),
    with the scheduler and trainer API beside it."""
    from .operator.kubeapi import Connection
    from .server import run_controller

    try:
        kube = Connection.from_kubeconfig(kubeconfig, context) if kubeconfig else Connection.in_cluster()
    except (ValueError, KeyError, OSError) as e:
        raise typer.BadParameter(f"kubeconfig {kubeconfig}: {e}" if kubeconfig else str(e)) from None
    settings = _settings(store)
    run_controller(data_dir or settings.data_dir, host, port, log_level, _kinds(executors), kube=kube,
                   settings=settings)


def _settings(store: str | None = None):
    """The controller's variables, read once here (its entry point); a bad value ends the command, naming it.
    `store`: `--store`, over $ROLLOUTD_STORE."""
    import dataclasses

    from rolloutd.crds.kit.settings import ControllerSettings, SettingsError

    try:
        settings = ControllerSettings.from_env()
    except SettingsError as e:
        typer.echo(f"rolloutd: {e}", err=True)
        raise typer.Exit(2) from None
    return dataclasses.replace(settings, store=store) if store else settings


def _kinds(executors: str) -> tuple[str, ...]:
    from .executors import registered

    kinds, known = tuple(k.strip() for k in executors.split(",") if k.strip()), sorted(registered())
    unknown = set(kinds) - set(known)
    if unknown:
        raise typer.BadParameter(f"unknown executor(s) {sorted(unknown)}; known: {', '.join(known)}")
    return kinds


@token_app.command("create")
def token_create(
    name: str = typer.Argument(..., help="the token's name (shown in 403 messages); its file is tokens/NAME.json"),
    read_only: bool = typer.Option(False, "--read-only", help="get, list and watch only (dashboards)"),
    namespace: list[str] = typer.Option([], "-n", "--namespace", help="limit to this namespace (repeat for more)"),
    data_dir: Path = typer.Option(None, help="the controller's data dir [default: $ROLLOUTD_DATA_DIR or ~/.local/share/rolloutd]"),
    output: Path = typer.Option(None, "-o", "--output", help="also write the bare token here (0600), for --token-file"),
) -> None:
    """Create a scoped token; the running controller accepts it at once. Prints the token unless -o is given."""
    import os

    from .access.auth import create_scoped_token
    from rolloutd.crds.kit.paths import DataDir

    try:
        scoped = create_scoped_token(DataDir(data_dir or _settings().data_dir).tokens, name, read_only=read_only,
                                     namespaces=namespace)
    except FileExistsError:
        raise typer.BadParameter(f"a token named {name!r} exists; delete its file to revoke it first") from None
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    if output is None:
        typer.echo(scoped.token)
        return
    fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(scoped.token + "\n")
    os.chmod(output, 0o600)
    typer.echo(f"wrote {output}")


@app.command("node-credential")
def node_credential(
    job: str = typer.Argument(..., help="the RolloutJob: NAME (namespace from -n, else default) or NAMESPACE/NAME"),
    namespace: str = typer.Option("default", "-n", "--namespace", help="the job's namespace"),
    controller: str = typer.Option(f"http://{DEFAULT_HOST}:{DEFAULT_PORT}", envvar="ROLLOUTD_CONTROLLER",
                                   help="the controller's URL"),
    token_file: Path = typer.Option(None, help="the admin token [default: the data dir's file 'token']"),
    ca_file: Path = typer.Option(None, envvar="ROLLOUTD_CA_FILE", help="CA of an https controller's certificate"),
) -> None:
    """Print a job's node credential, for daemons started by hand ($ROLLOUTD_JOIN_TOKEN of `rolloutd node`):
    it registers nodes for that job only and is revoked when the job finishes or is deleted. Admin token only."""
    import httpx

    from rolloutd.crds.names import job_path

    from rolloutd.crds.kit.paths import DataDir

    token = (token_file or DataDir(_settings().data_dir).token).read_text().strip()
    key = job if "/" in job else f"{namespace}/{job}"
    try:
        r = httpx.post(controller.rstrip("/") + job_path(key, "nodes", "credential"), timeout=30,
                       headers={"Authorization": f"Bearer {token}"}, verify=str(ca_file) if ca_file else True)
    except httpx.HTTPError as e:
        raise typer.BadParameter(f"cannot reach {controller}: {e}") from None
    if r.status_code != 200:
        typer.echo(f"{controller}: HTTP {r.status_code}: {r.text[:300]}", err=True)
        raise typer.Exit(1)
    typer.echo(r.json()["credential"])


@app.command()
def crd(
    output: Path = typer.Option(None, "-o", "--output", help="write here instead of crds/rolloutjob.yaml; '-' for stdout"),
) -> None:
    """Regenerate the Kubernetes CRD (crds/rolloutjob.yaml and the Helm chart's copy) and the docs' spec reference
    from the pydantic models."""
    from rolloutd.crds.kit import reference
    from rolloutd.crds.crd import CHART_CRD_PATH, CRD_PATH, render_crd

    text = render_crd()
    if output is not None and str(output) == "-":
        typer.echo(text, nl=False)
        return
    targets = [output] if output else [CRD_PATH] + ([CHART_CRD_PATH] if CHART_CRD_PATH.parent.is_dir() else [])
    for target in targets:  # the chart's folder exists in a checkout, not in an installed package
        target.write_text(text)
        typer.echo(f"wrote {target}")
    if output is None:  # the TenantPolicy's beside it
        from rolloutd.crds.crd import POLICY_CRD_PATH, render_policy_crd
        POLICY_CRD_PATH.write_text(render_policy_crd())
        typer.echo(f"wrote {POLICY_CRD_PATH}")
    if output is None and reference.DOCS_REFERENCE.parent.is_dir():  # docs/ too exists only in a checkout
        for page in reference.write():
            typer.echo(f"wrote {page}")


@app.command()
def version() -> None:
    """Print the version."""
    from .cli_common import installed_version

    typer.echo(installed_version())


def run() -> None:
    """The `rolloutd` console script: a command whose extra is not installed says which one to install."""
    try:
        app()
    except ModuleNotFoundError as e:
        if e.name is None or e.name.startswith("rolloutd"):
            raise
        typer.echo(f"rolloutd: {e.name} is not installed, and this command needs it: pip install "
                   "'rolloutd[controller]' for the controller, 'rolloutd[node]' for a node daemon", err=True)
        raise SystemExit(2) from None


if __name__ == "__main__":  # pragma: no cover
    run()
