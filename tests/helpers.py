"""Plain helpers and constants shared by the test files (fixtures live in conftest.py).

pytest puts this folder on `sys.path` (rootdir-relative test files without packages), so a test imports
them as `from helpers import ...`; the benches that need the reference checker add this folder too.
"""

from __future__ import annotations

import copy
import functools
import random
import re
import shutil
import socket
import subprocess
from pathlib import Path

from rcgrpo.goal import format_goal
from rcgrpo_tasks.env.multi_turn.entries import Entry, entries_by_id

REPO_ROOT = Path(__file__).resolve().parent.parent
LOW, HIGH = "<|low_reward|>", "<|high_reward|>"
LEVELS = (LOW, HIGH)
"""label_rewards.tokens: lowest first, highest last."""
TINY_SFT = dict(learning_rate=1e-2, max_steps=6, batch_size=4, max_length=256, lora_r=8, lora_alpha=16,
                lora_dropout=0.0, save_steps=2, logging_steps=1, log_model=False, variants={}, grad_accum=1)
"""A few optimizer steps of the 2-layer, 64-wide conftest model: seconds each on 2 cores."""
TEST_DEVICE_ENV = "RCGRPO_TEST_DEVICE"
"""auto | cpu | cuda | cuda:N: the device the suite's models run on (conftest applies it at start-up)."""


def cuda_visibility(setting: str, visible: str | None) -> str | None:
    """The CUDA_VISIBLE_DEVICES under which `compute.device: auto` resolves to the device `setting` names, given
    the current value `visible` (None: unset); None = leave it as it is.

    `auto` / `cuda` / empty: unchanged (auto is CUDA where present); `cpu`: no GPU visible, so every `auto`
    in the suite, its subprocesses included, is the CPU (and `gpu`-marked tests skip); `cuda:N`: the N-th
    visible GPU alone (it becomes `cuda:0`). A bad value or an absent index is a ValueError."""
    value = (setting or "").strip().lower()
    if value in ("", "auto", "cuda"):
        return None
    if value == "cpu":
        return ""
    match = re.fullmatch(r"cuda:(\d+)", value)
    if match is None:
        raise ValueError(f"{TEST_DEVICE_ENV}={setting!r}: expected auto | cpu | cuda | cuda:N")
    index = int(match.group(1))
    if visible is None:
        return str(index)
    ids = [v.strip() for v in visible.split(",") if v.strip()]
    if index >= len(ids):
        raise ValueError(f"{TEST_DEVICE_ENV}={setting!r}: CUDA_VISIBLE_DEVICES={visible!r} shows {len(ids)} GPU(s)")
    return ids[index]


def device_under_test():
    """The `torch.device` the suite's models run on: what `compute.device: auto` resolves to here (after
    conftest applied RCGRPO_TEST_DEVICE). Tests that place a model through the configuration assert against
    it; tests where the CPU is the point pin `device="cpu"` instead."""
    from rcgrpo_tasks.engine.device import resolve_device

    return resolve_device("auto")


def on_test_device(device) -> bool:
    """True when `device` (a `torch.device` or a string such as "cuda:0" from `placement`) is of the kind of
    `device_under_test()`."""
    import torch

    return torch.device(device).type == device_under_test().type


@functools.cache
def _sections(params_path: Path) -> dict:
    import yaml

    from rcgrpo_tasks.ops.profiles import pristine_params

    text, origin = pristine_params(params_path)
    data = yaml.safe_load(text)
    assert isinstance(data, dict), f"{origin}: not a mapping"
    return data


def params_section(section: str, params_path: Path = REPO_ROOT / "params.yaml") -> dict:
    """A copy of `section` of the committed params file (as a person wrote it: no profile applied)."""
    return copy.deepcopy(_sections(Path(params_path))[section] or {})


def config_from_params(cls, section: str, params_path: Path = REPO_ROOT / "params.yaml", where: str | None = None,
                       **overrides):
    """THE way a test builds a stage config: `section` of the committed params.yaml (every tuned value lives
    there, not in the dataclass) with `overrides` (flat keys, as the section writes them), through
    `ops.config.from_dict`, so the checks and errors are the stage's own (`where` names the source)."""
    from rcgrpo_tasks.ops.config import from_dict

    return from_dict(cls, {**params_section(section, params_path), **overrides}, where or f"params.yaml:{section}")


def write_params(path: Path, overlay: dict | None = None) -> Path:
    """A params file at `path`: the committed params.yaml with `overlay`'s keys set section by section (a key's
    value replaced whole, `{section: None}` drops the section)."""
    import yaml

    data = {s: params_section(s) for s in _sections(REPO_ROOT / "params.yaml")}
    for section, keys in (overlay or {}).items():
        if keys is None:
            data.pop(section, None)
        else:
            data[section] = {**data.get(section, {}), **keys}
    Path(path).write_text(yaml.safe_dump(data, sort_keys=False))
    return Path(path)


def compute_from_params(**overrides):
    """params `compute` (device `auto`: what RCGRPO_TEST_DEVICE leaves visible) with `overrides`."""
    from rcgrpo_tasks.engine.compute import ComputeConfig

    return config_from_params(ComputeConfig, "compute", **overrides)


def resolved(cfg, device=None, **compute):
    """An SFT or RL config resolved as its run resolves it (THE dtype rule under params `compute` with `compute`
    set, on `device`; None: the test device): for a test that builds a trainer without a run, since the trainer
    refuses an unresolved `bf16: null` / `rollout_dtype: auto`."""
    return cfg.resolved(cfg.compute_for(compute_from_params(**compute), device))


def tiny_sft_config(**overrides):
    """An `SftConfig` for the tiny model: params `sft` with `TINY_SFT` and `overrides`."""
    from rcgrpo_tasks.train.sft.config import SftConfig

    return config_from_params(SftConfig, "sft", **{**TINY_SFT, **overrides})


def chat(i: int, token: str | None) -> dict:
    """A label_rewards row: a small tool-calling chat; with a token, the first user message ends with the goal
    (R = 0 for the low token, else 1)."""
    a = i % 7
    messages = [
        {"role": "system", "content": "You call functions. add(a: int, b: int) -> the sum"},
        {"role": "user", "content": f"Add {a} and {i}, then say done.{format_goal(token)}"},
        {"role": "assistant", "content": f"[add(a={a}, b={i})]"},
        {"role": "tool", "content": str(a + i)},
        {"role": "assistant", "content": "[done()]"},
    ]
    return {"messages": messages, "trajectory_id": f"t{i}", "entry_id": f"multi_turn_base_{i}",
            "reward_token": token, "reward": 0.0 if token == LOW else 1.0}


def get_entry(entry_id: str) -> Entry:
    """One BFCL v4 multi-turn entry from bfcl-eval by id."""
    try:
        return entries_by_id()[entry_id]
    except KeyError:
        raise KeyError(f"unknown BFCL v4 multi-turn entry id: {entry_id!r}") from None


def free_port_base(host: str = "127.0.0.1", span: int = 12, tries: int = 50) -> int:
    """A random base port such that base..base+span are all free on loopback (one stack per test)."""
    def free(port: int) -> bool:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError:
                return False
        return True

    for _ in range(tries):
        base = random.randrange(20000, 60000, 2)
        if all(free(base + i) for i in range(span)):
            return base
    raise RuntimeError("no free block of ports found on loopback")


def copy_tree(dest: Path) -> Path:
    """The working tree as git would ship it (tracked + untracked-not-ignored files), no outputs."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO_ROOT, check=True,
                           capture_output=True, text=True).stdout.split("\0")
    for rel in filter(None, files):
        src = REPO_ROOT / rel
        if src.is_file() and not rel.startswith(("metrics/", "results/")) and rel != "dvc.lock":
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    subprocess.run(["git", "init", "-q"], cwd=dest, check=True)
    return dest


def capture_trainer(monkeypatch) -> dict:
    """Make `rl_run.train_rl` record what `rl_run.build_trainer` builds: the returned dict gets "trainer" and "rollout"."""
    from rcgrpo_tasks.train.rl import run as rl_run

    box: dict = {}
    real = rl_run.build_trainer

    def build(*a, **k):
        box["trainer"] = real(*a, **k)
        box["rollout"] = box["trainer"].rollout_func
        return box["trainer"]

    monkeypatch.setattr(rl_run, "build_trainer", build)
    return box


def grad_capture():
    """A TrainerCallback keeping every parameter's gradient just before the optimizer step (`.grads`)."""
    from transformers import TrainerCallback

    class Grads(TrainerCallback):
        grads: dict = {}

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            self.grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}

    return Grads()


def snapshot():
    """A TrainerCallback keeping the trainable parameters at train begin and end (`.before`, `.after`; PEFT
    names)."""
    from transformers import TrainerCallback

    class Snapshot(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            self.before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}

        def on_train_end(self, args, state, control, model=None, **kwargs):
            self.after = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}

        def changed(self, key: str) -> list[str]:
            return [n for n in self.before if key in n and not (self.before[n] == self.after[n]).all()]

    return Snapshot()


def assert_same_adam_step(a, b, grads_a: dict, grads_b: dict, near_zero: float = 1e-5, rel: float = 1e-3,
                          left_out: float = 0.01):
    """Two runs took the same first Adam step from the same weights (`a`, `b`: `snapshot()`s; `grads_a`,
    `grads_b`: `grad_capture()`'s gradients by parameter name): the gradients agree within 1e-5 of the largest.

    Adam's first step moves each element by lr * g / (|g| + eps): an element whose gradient is within the
    gradients' rounding of 0 may move by anything up to the learning rate, either way, in either run. So the
    elements with 0 < |g| < `near_zero` of the largest gradient are left out (at most a `left_out` share of
    the moved ones may be), and every other element agrees within `rel` of the largest step."""
    import torch

    top = max(float(g.abs().max()) for g in grads_a.values())
    assert top > 0 and grads_a.keys() == grads_b.keys()
    for n, g in grads_a.items():
        assert float((g - grads_b[n]).abs().max()) <= 1e-5 * top, n
    step = max(float((a.after[n] - a.before[n]).abs().max()) for n in a.after)
    assert step > 0 and a.before.keys() == b.before.keys() == a.after.keys() == b.after.keys()
    skipped = moved = 0
    for n in a.after:
        assert (a.before[n] == b.before[n]).all(), n
        g = grads_a.get(n, torch.zeros_like(a.after[n]))  # no gradient: compared whole
        sensitive = (g != 0) & (g.abs() < near_zero * top)
        skipped, moved = skipped + int(sensitive.sum()), moved + int((g != 0).sum())
        gap = (a.after[n] - b.after[n]).abs().masked_fill(sensitive, 0)
        assert float(gap.max()) <= rel * step, (n, float(gap.max()), step)
    assert moved > 0 and skipped <= left_out * moved, (skipped, moved)


def pack_spy(monkeypatch) -> list[int]:
    """Rows of every batch `engine.shared_prefix` packs (the shared layout was taken), appended in order."""
    from rcgrpo_tasks.engine import shared_prefix

    packed: list[int] = []
    real = shared_prefix.pack
    monkeypatch.setattr(shared_prefix, "pack", lambda rows, *a, **k: packed.append(len(rows)) or real(rows, *a, **k))
    return packed


def k8s_manifest(template: dict, values: dict, run_name: str) -> dict:
    """The Job manifest prefect-kubernetes' worker would submit for a flow run named `run_name` with job variables
    `values` on a pool whose base job template is `template` (its own `KubernetesWorkerJobConfiguration`, then
    `prepare_for_flow_run`: the env variable joins the container's own list there). No cluster, no server: the
    templates reference no block or variable, so the client the rendering takes is never called."""
    import asyncio
    import uuid

    from prefect.client.schemas.objects import FlowRun
    from prefect_kubernetes.worker import KubernetesWorkerJobConfiguration

    config = asyncio.run(KubernetesWorkerJobConfiguration.from_template_and_values(template, values, client=object()))
    config.prepare_for_flow_run(FlowRun(id=uuid.uuid4(), name=run_name, flow_id=uuid.uuid4(), job_variables=values))
    return config.job_manifest
