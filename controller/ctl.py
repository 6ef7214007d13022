"""`rolloutctl`: the user's CLI (placeholder until the foundation lands)."""
import typer

app = typer.Typer(no_args_is_help=True, add_completion=False)


@app.callback()
def _main() -> None:
    """rolloutctl."""
