"""Resume exact: a run cut after a checkpoint and resumed ends as the uninterrupted run, bit for bit.

Each test trains the same run twice on the tiny model: once uninterrupted, once cut and resumed. The cut
comes where a SIGKILL leaves the most behind: after checkpoint k was written and the next step's rollouts,
diagnostics row and probe point were written too, before checkpoint k + 1 (a callback raises at that step's
log; the resumed run is a new trainer in a new `train_*` call, as a rerun of the stage). Then the outputs
are compared: every tensor of the saved model (`torch.equal`), every output file's bytes, the metrics JSON,
the steps TSV, the rollout log, the probe points and the MLflow step metrics, all equal except the
wall-clock fields (`WALL_CLOCK`) and `resumed_from`, which names the checkpoint the cut run resumed from.

On the CPU: some CUDA kernels (atomic adds in backward passes) are not bit-for-bit reproducible from run to
run, so there the comparison would measure the kernels rather than the resume (docs/rl.md, "Resume").
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
from helpers import HIGH, LEVELS, LOW, chat, compute_from_params, config_from_params, tiny_sft_config
from test_rl import PROTOCOL, TEST_RL, _spec, scripted_rewards  # noqa: F401 (a fixture)

from rcgrpo_tasks.ops.inputs import read_tsv
from rcgrpo_tasks.ops.outputs import write_json, write_jsonl
from rcgrpo_tasks.train.rl import config as rl_config
from rcgrpo_tasks.train.rl import run as rl_run
from rcgrpo_tasks.train.rl.grpo import ROLLOUTS_FILE
from rcgrpo_tasks.train.rl.probe import PROBE_FILE
from rcgrpo_tasks.train.sft import config as sft_config
from rcgrpo_tasks.train.sft import run as sft_run

WALL_CLOCK = {"train_s", "rollout_s", "rollout_tokens_per_s", "step_time", "tokens_per_s", "seconds",
              "train_runtime", "train_samples_per_second", "train_steps_per_second"}
"""Fields (summary keys, TSV columns, log keys, with any prefix `mean_`, `rc/`, `diag/`, `summary/`) that time
the run: the only ones a resumed run may differ in."""


class Cut(Exception):
    """The simulated kill."""


def cut_after(k: int):
    """A callback that kills the run at step k + 1's log: checkpoint k is written, step k + 1's files too."""
    from transformers import TrainerCallback

    class CutAfter(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if state.global_step == k + 1 and "loss" in (logs or {}):
                raise Cut(f"cut after checkpoint-{k}")

    return CutAfter()


def timed(key: str) -> bool:
    return key.rpartition("/")[2].removeprefix("mean_") in WALL_CLOCK


def untimed(value):
    """`value` (a summary, a row, a list of them) without its wall-clock fields, as canonical JSON."""
    def strip(v):
        if isinstance(v, dict):
            return {k: strip(x) for k, x in v.items() if not timed(k)}
        return [strip(x) for x in v] if isinstance(v, list) else v
    return json.dumps(strip(value), sort_keys=True)


def assert_same_folder(a: Path, b: Path) -> None:
    """Every file of `a` in `b` with the same bytes; every tensor of each safetensors file equal."""
    import torch
    from safetensors.torch import load_file

    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    for rel in (f for f in files if f.suffix == ".safetensors"):
        x, y = load_file(a / rel), load_file(b / rel)
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), rel
    for rel in files:
        assert (a / rel).read_bytes() == (b / rel).read_bytes(), rel


def mlflow_curves(run_id: str) -> dict:
    """Every untimed metric of an MLflow run: {key: [(step, value), ...]} (system metrics left out)."""
    import mlflow

    client = mlflow.MlflowClient()
    keys = [k for k in client.get_run(run_id).data.metrics if not timed(k) and not k.startswith("system/")]
    return {k: sorted((m.step, m.value) for m in client.get_metric_history(run_id, k)) for k in keys}


def finished_runs_since(t0: float) -> list[str]:
    import mlflow

    runs = mlflow.search_runs(search_all_experiments=True, filter_string=f"attributes.start_time >= {int(t0 * 1000)}",
                              order_by=["start_time ASC"], output_format="list")
    return [r.info.run_id for r in runs if r.info.status == "FINISHED"]


def assert_same_curves(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert [s for s, _ in a[key]] == [s for s, _ in b[key]], key
        assert all(x == y or (math.isnan(x) and math.isnan(y)) for (_, x), (_, y) in zip(a[key], b[key])), key


# ------------------------------------------------------------------------------------------------ RL


@pytest.mark.parametrize("minibatches,probe", [(1, 1), (2, 0)], ids=["one-step-per-generation", "two-steps-per-generation"])
def test_a_cut_rl_run_resumes_to_the_uninterrupted_one(rl_env, scripted_rewards, minibatches, probe):  # noqa: F811
    """RC-GRPO cell, 3 steps, cut after checkpoint 1. With two optimizer steps per generation (TRL's
    `steps_per_generation` 2) the cut falls inside a generation batch, which the resumed run must train on
    as the uninterrupted one did (not generate anew). Divergence guard and MLflow tracking on; the probe
    (at steps 0, 1, 3) on one of the two."""
    root, model_dir = rl_env
    steps = 3
    cfg = config_from_params(rl_config.RLConfig, "rl", **{
        **TEST_RL, "categories": ("base",), "max_steps": steps, "minibatches": minibatches, "max_entries": 4,
        "probe_entries": probe, "probe_transfer_entries": 0, "probe_samples": 2})
    t0 = time.time()
    full = _spec(root, model_dir, f"full-{minibatches}", "rctp", "rc_grpo")
    uncut = rl_run.train_rl(cfg, PROTOCOL, LEVELS, full, compute=compute_from_params(device="cpu"))
    cut = _spec(root, model_dir, f"cut-{minibatches}", "rctp", "rc_grpo")
    with pytest.raises(Cut):
        rl_run.train_rl(cfg, PROTOCOL, LEVELS, cut, callbacks=[cut_after(1)], compute=compute_from_params(device="cpu"))
    assert [r["step"] for r in read_tsv(cut.checkpoints / "diagnostics.tsv")] == [1, 2]  # step 2's row: left over
    resumed = rl_run.train_rl(cfg, PROTOCOL, LEVELS, cut, compute=compute_from_params(device="cpu"))

    assert uncut["resumed_from"] is None and resumed["resumed_from"] == str(cut.checkpoints / "checkpoint-1")
    assert_same_folder(full.out, cut.out)
    assert untimed({**uncut, "resumed_from": None}) == untimed({**resumed, "resumed_from": None})
    assert untimed(read_tsv(full.plots)) == untimed(read_tsv(cut.plots))
    assert len(read_tsv(full.plots)) == steps
    for name in (ROLLOUTS_FILE, PROBE_FILE)[:2 if probe else 1]:
        assert (full.checkpoints / name).read_bytes() == (cut.checkpoints / name).read_bytes(), name
    first, last = finished_runs_since(t0)
    assert_same_curves(mlflow_curves(first), mlflow_curves(last))


# ------------------------------------------------------------------------------------------ SFT / RCTP


@pytest.fixture(scope="module")
def margin_entries(tmp_path_factory) -> Path:
    """A single-turn entries file and split (with its dev side, which the margin curve reads)."""
    from rcgrpo_tasks.env.split import PrepareDataConfig, prepare

    root = tmp_path_factory.mktemp("margin_entries")
    entries, split = prepare(config_from_params(PrepareDataConfig, "prepare_data", task="single_turn",
                                                categories=("simple_python", "multiple")))
    write_jsonl(root / "entries.jsonl", (e.to_json() for e in entries))
    write_json(root / "split.json", split)
    return root


SFT_CASES = {
    # TRL's random sampler over 2 epochs, LoRA dropout; cut on the epoch boundary (step 4 of 4 per epoch)
    "sft": (dict(lora_dropout=0.1, num_epochs=2, max_steps=6, save_steps=2), 4,
            [chat(i, HIGH if i % 2 else LOW) for i in range(16)]),
    # RCTP: pairs in the dataset's own order, the token rows' own rate, the first-token weight and unlikelihood,
    # the margin curve; cut inside the first epoch
    "rctp": (dict(lora_dropout=0.1, num_epochs=3, max_steps=6, save_steps=2, batch_size=2, row_order="pairs",
                  margin_every=2, margin_entries=2, token_lr_multiplier=10.0, require_reward_token=True,
                  first_token_weight=4.0, unlikelihood=1.0), 2,
             [dict(chat(i // 2, LEVELS[i % 2]), entry_id=f"e{i // 2}") for i in range(16)]),
}


@pytest.mark.parametrize("variant", list(SFT_CASES))
def test_a_cut_sft_run_resumes_to_the_uninterrupted_one(variant, tiny_model_dir, margin_entries, store, tmp_path):
    """6 steps, cut after checkpoint k (`SFT_CASES`); then the finished run rerun: restored from its last
    checkpoint, not trained, with the same summary (its margin curve included)."""
    from rcgrpo_tasks.env.prompt import PromptConfig

    overrides, k, rows = SFT_CASES[variant]
    write_jsonl(tmp_path / "rows.jsonl", rows)
    cfg = tiny_sft_config(**overrides, keep_checkpoints=True)
    kw = dict(compute=compute_from_params(device="cpu"), prompt=config_from_params(PromptConfig, "prompt"))

    def spec(name):
        return sft_config.SftRun(variant, tiny_model_dir, tmp_path / "rows.jsonl", tmp_path / name / "out",
                                 tmp_path / name / "ckpt", tmp_path / name / "m.json", tmp_path / name / "s.tsv",
                                 entries=margin_entries / "entries.jsonl", split=margin_entries / "split.json")

    t0 = time.time()
    full, cut = spec("full"), spec("cut")
    uncut = sft_run.train_variant(cfg, LEVELS, full, **kw)
    with pytest.raises(Cut):
        sft_run.train_variant(cfg, LEVELS, cut, callbacks=[cut_after(k)], **kw)
    resumed = sft_run.train_variant(cfg, LEVELS, cut, **kw)

    assert uncut["resumed_from"] is None and resumed["resumed_from"] == str(cut.checkpoints / f"checkpoint-{k}")
    assert_same_folder(full.out, cut.out)
    assert untimed({**uncut, "resumed_from": None}) == untimed({**resumed, "resumed_from": None})
    assert untimed(read_tsv(full.plots)) == untimed(read_tsv(cut.plots)) and len(read_tsv(full.plots)) == 6
    if variant == "rctp":
        assert [p["step"] for p in resumed["margin_curve"]] == [0, 2, 4, 6]
    first, last = finished_runs_since(t0)
    assert_same_curves(mlflow_curves(first), mlflow_curves(last))
    again = sft_run.train_variant(cfg, LEVELS, cut, **kw)
    assert again["resumed_from"] == str(cut.checkpoints / "checkpoint-6")
    assert untimed({**uncut, "resumed_from": None}) == untimed({**again, "resumed_from": None})
