"""The ONE way a stage command reports a problem: `error: <message naming the file/field>` on stderr, exit 2.

Every stage and command wraps its work in `with cli_errors():` — ConfigError, InputError and any ValueError
subclass the library raises for bad input (ModelLoadError, TrajectoryError, ...) end the command with exit 2
and one line, never a traceback. `fail(exc, code)` is the same for a caught error; a failed quality gate
uses code 1 (the data was read fine and did not pass), everything a user fixes in input or params code 2.
`Progress` is the tqdm bar the decoding commands share.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import typer

from rcgrpo_tasks.ops.config import ConfigError
from rcgrpo_tasks.ops.inputs import InputError

USAGE_EXIT = 2
GATE_EXIT = 1


class CommandFailed(typer.Exit):
    """The exit a command takes on bad input: carries its message, so a run record (the MLflow run's
    `rcgrpo.error` tag) says why, not `Exit: 2`."""

    def __init__(self, message: str, code: int):
        super().__init__(code)
        self.message = message

    def __str__(self) -> str:
        return self.message


def fail(exc: BaseException | str, code: int = USAGE_EXIT) -> None:
    """Print `error: ...` to stderr and exit with `code`."""
    typer.echo(f"error: {exc}", err=True)
    raise CommandFailed(str(exc), code) from (exc if isinstance(exc, BaseException) else None)


@contextlib.contextmanager
def cli_errors(*extra: type[BaseException]) -> Iterator[None]:
    """Turn bad params / input (ConfigError, InputError, ValueError and `extra`) into `fail(exc)`."""
    try:
        yield
    except (ConfigError, InputError, ValueError, *extra) as exc:
        fail(exc)


class Progress:
    """tqdm bar over rollouts showing rollouts/s and model tokens/s."""

    def __init__(self, total: int, desc: str = "rollouts"):
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc=desc, unit="rollout", dynamic_ncols=True)
        self.t0, self.tokens = time.perf_counter(), 0

    def __call__(self, trajs) -> None:
        self.tokens += sum(t.n_model_tokens for t in trajs)
        self.bar.update(len(trajs))
        dt = max(time.perf_counter() - self.t0, 1e-9)
        self.bar.set_postfix({"rollouts/s": f"{self.bar.n / dt:.2f}", "tok/s": f"{self.tokens / dt:.1f}"})

    def close(self) -> None:
        self.bar.close()
