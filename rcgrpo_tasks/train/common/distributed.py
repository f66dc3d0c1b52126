"""Training across processes: the launcher of the `sft` and `rl` stages and what their processes share.

- `relaunch(compute, command, options)`: with params `compute.processes` N > 1, a training stage re-runs
  its own command under `accelerate launch` in N processes (`python -m rcgrpo_tasks.cli <command> ...`
  in each) and waits, so `dvc repro` and the Prefect flow run it unchanged. No accelerate config: plain
  data parallel (`--multi_gpu`: NCCL on GPUs; gloo processes on a CPU, one share of the cores each);
  `compute.accelerate_config`: that file (DeepSpeed ZeRO-3, ...), its process count overridden. A stop
  signal to the stage goes to the launcher alone, which passes it to every process once (a second
  signal would abort the checkpoint of the current step), then the launch is killed after the grace.
  Inside a launch (`in_launch`: torchrun / accelerate set LOCAL_RANK), or with one process, nothing is
  relaunched: a multi-node launch started by hand runs the same stage command.
- `process_state(device)`: accelerate's process state, created first and told about the CPU: accelerate
  makes CPU processes a gloo group only when told (`PartialState(cpu=True)`); otherwise each process of
  a CPU launch would train alone on the whole batch.
- `any_process(flag)`, `gather(obj)`: the collectives the stages need (OR of a flag, every process's
  object in process order); without a process group they are the identity.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path
from typing import Any

from rcgrpo_tasks.engine.compute import ComputeConfig
from rcgrpo_tasks.ops import stops
from rcgrpo_tasks.ops.config import ConfigError

LAUNCH_GRACE_S = 60.0
"""How long a stopped launch may take to checkpoint its step and exit before it is killed (longer than
`callbacks.STOP_GRACE_S`, the processes' own limit for finishing the step)."""


def in_launch() -> bool:
    """True in a process started by a distributed launcher (torchrun, accelerate launch, deepspeed)."""
    return "LOCAL_RANK" in os.environ


def should_launch(compute: ComputeConfig) -> bool:
    """Whether a training stage must re-run itself under `accelerate launch` (N > 1, not launched yet)."""
    return compute.processes > 1 and not in_launch()


def _free_port() -> int:
    # The rendezvous port of a single-node launch: a fixed one would make two concurrent stages collide.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli_options(values: dict[str, Any]) -> list[str]:
    """A typer command's parsed options (`click` context params) back to `--name value` arguments; None
    (an option not given) is left out."""
    out: list[str] = []
    for name, value in values.items():
        if value is None:
            continue
        out += [f"--{name.replace('_', '-')}", str(value)]
    return out


def launch_command(compute: ComputeConfig, device, argv: list[str]) -> list[str]:
    """The `accelerate launch` command line running `python -m rcgrpo_tasks.cli *argv` in
    `compute.processes` processes on `device` (the resolved `compute.device`)."""
    n = compute.processes
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(n), "--num_machines", "1",
           "--main_process_port", str(_free_port()), "--dynamo_backend", "no"]
    if compute.accelerate_config:
        path = Path(compute.accelerate_config)
        if not path.is_file():
            raise ConfigError(f"compute.accelerate_config {path}: no such file")
        cmd += ["--config_file", str(path)]
    else:
        cmd += ["--multi_gpu", "--mixed_precision", "no"]  # precision: the stage's own bf16 setting
    if device.type == "cpu":
        cmd += ["--num_cpu_threads_per_process", str(max(1, (os.cpu_count() or 1) // n))]
    return [*cmd, "-m", "rcgrpo_tasks.cli", *argv]


def relaunch(compute: ComputeConfig, device, command: str, options: dict[str, Any]) -> int:
    """Run stage `command` with `options` (its parsed CLI options) in `compute.processes` processes and
    return the launch's exit code (0 when every process succeeded). A stop signal is passed on once and
    re-raised here (`stops.Terminated`) when the launch is gone."""
    cmd = launch_command(compute, device, [command, *cli_options(options)])
    print(f"rcgrpo {command}: {compute.processes} processes under accelerate launch "
          f"({compute.accelerate_config or 'data parallel'}, {device.type})", file=sys.stderr, flush=True)
    proc = stops.start_group(cmd, die_with_us=True, env={**os.environ, "RCGRPO_DIE_WITH_PARENT": "1"})
    try:
        code = proc.wait()
    except BaseException:  # Terminated, KeyboardInterrupt: stop the launch before unwinding
        stops.stop_group(proc, LAUNCH_GRACE_S, leader_first=True)
        raise
    if code:
        print(f"error: rcgrpo {command}: the launch of {compute.processes} processes exited with code {code}",
              file=sys.stderr, flush=True)
    return code


def process_state(device):
    """accelerate's `PartialState` of this process, on the CPU when `device` is (see the module docstring)."""
    from accelerate import PartialState

    return PartialState(cpu=device is not None and device.type == "cpu")


def _group():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 else None


def any_process(flag: bool) -> bool:
    """`flag` OR-ed over every process (every rank must take the same branch: stop, skip a step)."""
    dist = _group()
    if dist is None:
        return flag
    import torch

    # NCCL reduces tensors on the process's current GPU, gloo on the CPU.
    t = torch.tensor(float(flag), device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def gather(obj: Any) -> list[Any]:
    """[obj of process 0, obj of process 1, ...] (picklable objects; every process must call it); [obj]
    in one process."""
    dist = _group()
    if dist is None:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
