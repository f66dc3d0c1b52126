"""`rcgrpo` console script: one sub-command per stage module, imported only when it runs.

Each stage module `rcgrpo_tasks/stages/<stage>.py` exposes a Typer `app` (its thin CLI); this dispatcher maps
`rcgrpo <command> ...` to that app so `rcgrpo --help` stays instant (no torch import) and every stage is
also runnable as `python -m rcgrpo_tasks.stages.<stage>`.
"""

from __future__ import annotations

import contextlib
import errno
import importlib
import os
import sys
from pathlib import Path

from rcgrpo_tasks.ops import recovery, rundir, stops, tracking_store
from rcgrpo_tasks.ops.outputs import OutputError

# command -> (module, one-line summary). Keep in the order of the pipeline.
COMMANDS: dict[str, tuple[str, str]] = {
    "params": ("rcgrpo_tasks.stages.params", "Materialize a profile (configs/<name>.yaml) into params.yaml."),
    "prepare-data": ("rcgrpo_tasks.stages.prepare_data", "Load the task's BFCL v4 entries (single-turn AST or multi-turn) from bfcl-eval and split them."),
    "prepare-model": ("rcgrpo_tasks.stages.prepare_model", "Turn the bundled SmolLM2 GGUF (or a hub id / folder) into a trainable HF folder."),
    "score": ("rcgrpo_tasks.stages.score", "Score a BFCL result JSONL with the official-semantics scorer."),
    "rollout": ("rcgrpo_tasks.stages.rollout", "Roll a model over BFCL entries and write trajectory JSONL."),
    "evaluate": ("rcgrpo_tasks.stages.evaluate", "Evaluate a model on the held-out split: metrics, report, plot."),
    "generate-trajectories": ("rcgrpo_tasks.stages.generate_trajectories", "Build the mixed-quality trajectory set (expert, policy, near-miss)."),
    "validate-trajectories": ("rcgrpo_tasks.stages.validate_trajectories", "Great Expectations quality gate on the trajectory set."),
    "label-rewards": ("rcgrpo_tasks.stages.label_rewards", "Map scores to reward tokens; write the sft and rctp chat datasets."),
    "sft": ("rcgrpo_tasks.stages.sft", "SFT / RCTP fine-tuning with TRL SFTTrainer + PEFT LoRA."),
    "sample-policy": ("rcgrpo_tasks.stages.sample_policy", "Sample the SFT model on train entries until each has a success and a failure."),
    "controllability": ("rcgrpo_tasks.stages.controllability", "Does a reward-conditioned model read its token: margin, paired sampled and greedy gaps."),
    "rl": ("rcgrpo_tasks.stages.rl", "GRPO / RC-GRPO on TRL GRPOTrainer over the project's rollout engine."),
    "dev-sweep": ("rcgrpo_tasks.stages.dev_sweep", "Try RL's levers side by side and judge them on the dev split."),
    "report": ("rcgrpo_tasks.stages.report", "Assemble the results table (with CIs and the paper's numbers) and plot."),
    "endpoints": ("rcgrpo_tasks.stages.endpoints", "Recompute the report's endpoints table from its committed per-unit files."),
    "promote": ("rcgrpo_tasks.stages.promote", "Register the best RL policy of the grid and move the `champion` alias if it wins."),
    "check-params": ("rcgrpo_tasks.stages.check_params", "Check the whole params file (every section, every rule across sections): the pipeline's root stage."),
    "plan": ("rcgrpo_tasks.stages.plan", "Write the DVC pipeline as a plan that runs without DVC (for a GPU host)."),
    "run-plan": ("rcgrpo_tasks.stages.run_plan", "Run a plan from `rcgrpo plan` without DVC; bundle the results."),
    "stack": ("rcgrpo_tasks.stages.stack", "Start/stop/check the local stack: Prefect, MLflow, SeaweedFS S3."),
}


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["Usage: rcgrpo COMMAND [ARGS]...", "", "RC-GRPO pipeline on BFCL v4 (single-turn AST and multi-turn tasks).", "", "Commands:"]
    lines += [f"  {name:<{width}}  {summary}" for name, (_, summary) in COMMANDS.items()]
    lines += ["", "Run `rcgrpo COMMAND --help` for a command's options."]
    return "\n".join(lines)


# Commands that open an MLflow run: their tracking server is checked (seconds) before they do any work.
TRACKED = frozenset({"prepare-model", "generate-trajectories", "validate-trajectories", "label-rewards", "sft",
                     "sample-policy", "controllability", "rl", "evaluate", "report", "promote"})
# Commands that write pipeline outputs: each marks itself running in the checkout's run folder (ops.rundir), so
# a kill leaves a trace the next command, and the next `dvc repro`, clears (ops.recovery).
MARKED = TRACKED | {"prepare-data", "rollout", "score", "dev-sweep"}


DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EROFS, errno.EACCES})
"""Errors of the output's filesystem (full, file too large, read-only, denied): one line, never a traceback."""


def guarded(name: str, run) -> int:
    """Run command `name` (`run()` returns its exit code) the way a pipeline stage must run: first what a killed
    stage left in this checkout is cleared (`ops.recovery`), and a command that writes outputs (`MARKED`) marks
    itself running (`ops.rundir.marker`); under DVC it dies with `dvc repro` (ops.stops.die_with_parent: nothing
    is written after its parent is gone);
    SIGTERM/SIGHUP unwind it (temp outputs removed, MLflow run KILLED); a tracked command checks its
    tracking server first; a tracking failure, an output another process holds or cannot be written
    (`ops.outputs.OutputError`, `DISK_ERRNOS`) and a stop are one line on stderr, never a traceback (exit 2, or
    128 + signal for a stop)."""
    if os.environ.get("DVC_STAGE") or os.environ.get("RCGRPO_DIE_WITH_PARENT"):
        stops.die_with_parent()
    handlers = stops.raise_on_terminate()
    try:
        recovery.recover(Path.cwd(), f"rcgrpo {name}")  # what a killed stage left here, before anything else
        if name in TRACKED:
            tracking_store.preflight()
        with rundir.marker(f"rcgrpo {name}") if name in MARKED else contextlib.nullcontext():
            return run()
    except (tracking_store.TrackingError, OutputError) as exc:
        print(f"error: rcgrpo {name}: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        if exc.errno not in DISK_ERRNOS:
            raise
        print(f"error: rcgrpo {name}: {exc.strerror or exc}"
              f"{f': {exc.filename}' if exc.filename else ''}; nothing was published", file=sys.stderr)
        return 2
    except stops.Terminated as exc:
        print(f"error: rcgrpo {name} {exc}; stopped, no output published", file=sys.stderr)
        return 128 + exc.signum
    finally:
        stops.restore(handlers)


HASH_SEED = "0"


def fix_hash_seed() -> None:
    """Re-execute this very command line (`sys.orig_argv`, same PID) with PYTHONHASHSEED=0 unless the
    variable is already set. Why: some bfcl-eval tool replies print a Python set (e.g. travel_booking's
    "Must be one of {'business', 'economy', 'first'}"), whose order follows the per-process hash seed, so
    without a fixed seed the trajectory sets (and `dvc.lock`) differ from run to run. An explicit
    PYTHONHASHSEED is respected."""
    if os.environ.get("PYTHONHASHSEED") is None:
        os.environ["PYTHONHASHSEED"] = HASH_SEED
        os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])


def main(argv: list[str] | None = None) -> int:
    """`argv` None: the console script (fixes the hash seed first, `fix_hash_seed`); a list: in-process."""
    if argv is None:
        fix_hash_seed()
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help", "help"):
        try:
            print(_usage())
        except BrokenPipeError:  # `rcgrpo --help | head`
            pass
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"rcgrpo: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])

    def run() -> int:
        try:
            module.app(args=rest, prog_name=f"rcgrpo {name}", standalone_mode=True)
        except SystemExit as exc:  # typer/click exit codes pass through
            return int(exc.code or 0) if not isinstance(exc.code, str) else 1
        return 0

    return guarded(name, run)


if __name__ == "__main__":
    sys.exit(main())
