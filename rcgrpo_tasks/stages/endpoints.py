"""`rcgrpo endpoints --recompute results/report/endpoints`: the report's endpoints table again, from the committed
per-unit values alone (no model, no evaluation, no RL run read).

The report stage writes, beside its table, one small JSON file per declared endpoint (`--endpoints`): the
pairs (cell's value, versus' value) per unit and seed, or the sign counts per seed, with `index.json` (alpha,
power, seeds, the order). This command recomputes every endpoint's statistics from those files with the
report's own functions (`evaluation.endpoints.recompute`) and prints the table as the report prints it
(`evaluation.endpoint_tables.endpoints_table`). `--check TABLE` compares it with the `## Endpoints` section of
a report's Markdown and exits 1, naming the first differing line, where they differ.
"""

from __future__ import annotations

from pathlib import Path

import typer

from rcgrpo_tasks.evaluation.endpoint_tables import endpoints_table
from rcgrpo_tasks.evaluation.endpoints import recompute
from rcgrpo_tasks.ops.cli import cli_errors, fail
from rcgrpo_tasks.ops.inputs import InputError

app = typer.Typer(add_completion=False, help=__doc__.split("\n\n")[0])
SECTION = "## Endpoints\n\n"


def table_section(markdown: str) -> str:
    """The body of a report's `## Endpoints` section (up to the next `## ` heading)."""
    if SECTION not in markdown:
        raise InputError("no '## Endpoints' section in the report's Markdown")
    body = markdown.split(SECTION, 1)[1]
    return body.split("\n## ", 1)[0].rstrip("\n") + "\n"


def first_difference(want: str, got: str) -> str:
    """`line N: <want's line> vs <got's line>` at the first line where two texts differ."""
    a, b = want.splitlines(), got.splitlines()
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"line {n + 1}: {(a[n] if n < len(a) else '<end>')!r} vs {(b[n] if n < len(b) else '<end>')!r}"


@app.command()
def main(
    recompute_dir: Path = typer.Option(Path("results/report/endpoints"), "--recompute",
                                       help="The report's endpoints folder (its --endpoints output)."),
    check: Path | None = typer.Option(None, help="A report's table.md: exit 1 unless its endpoints table is "
                                                 "the one recomputed."),
) -> None:
    """Recompute the endpoints table from the per-unit files; print it (and compare it)."""
    with cli_errors():
        results, alpha, power, seeds, declared = recompute(recompute_dir)
        table = endpoints_table(results, alpha, power, seeds, declared)
        want = table_section(check.read_text()) if check is not None else None
    typer.echo(table, nl=False)
    if want is not None and want != table:
        fail(f"endpoints: the recomputed table differs from {check}: {first_difference(want, table)}", code=1)
    if want is not None:
        typer.echo(f"endpoints: equal to {check}'s table ({len(results)} endpoints)")


if __name__ == "__main__":
    app()
