"""`rcgrpo stack up|down|status|env`: the local stack without Docker (SeaweedFS S3, MLflow, Prefect server and
worker on loopback; `ops.stack` does the work, docs/operations.md explains it)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import typer

from rcgrpo_tasks.ops.stack import down, status, up, write_env_file
from rcgrpo_tasks.ops.stack_state import StackError, make_stack

app = typer.Typer(add_completion=False)


@app.command()
def main(
    action: Literal["up", "down", "status", "env"] = typer.Argument(..., help="up | down | status | env"),
    state_dir: Path = typer.Option(Path(".stack"), help="Logs, PIDs, SQLite DBs and S3 data live here."),
    port_base: int | None = typer.Option(None, help="Use ports base, base+2, ... instead of infra/services.yaml."),
    worker: bool = typer.Option(False, help="Also start a Prefect process worker for the rcgrpo-cpu pool."),
    dvc_repo: Path = typer.Option(Path("."), help="Repo whose .dvc/config.local gets the S3 remote."),
    grid_workers: int = typer.Option(0, min=0, help="Also start N workers for the grid across pools (`--dispatch "
                                                   "pools`), each in its own directory under the state folder."),
    git_url: str | None = typer.Option(None, help="The repository the grid workers fetch commits from."),
) -> None:
    """Start/stop/check the local stack: Prefect, MLflow, SeaweedFS S3 (no Docker)."""
    stack = make_stack(state_dir, port_base)
    try:
        if action == "up":
            repo = dvc_repo if (dvc_repo / ".dvc").is_dir() else None
            up(stack, repo=repo, worker=worker, grid_workers=grid_workers, git_url=git_url)
            typer.echo(f"stack up; `source {write_env_file(stack)}` for the client env")
        elif action == "down":
            typer.echo(f"stopped: {', '.join(down(stack)) or 'nothing'}")
        elif action == "env":
            typer.echo(write_env_file(stack).read_text(), nl=False)
        if action in ("up", "status"):
            for name, text in status(stack).items():
                typer.echo(f"{name:8} {text}")
    except StackError as exc:
        typer.echo(f"rcgrpo stack {action}: {exc}", err=True)
        raise typer.Exit(1) from exc


if __name__ == "__main__":
    app()
