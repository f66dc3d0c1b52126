"""Training across processes (`compute.processes`, `train.common.distributed`): the launcher's command line, groups
seeded by their place in the batch whatever process decodes them, and the real thing: the `sft` and `rl`
stage commands run under `accelerate launch` in two gloo processes on the CPU against one process at twice
the micro-batch (the same rollouts, rewards, advantages, losses and weights), and a two-process RL run
stopped by SIGTERM and resumed (~25-35 s each on 2 cores: process start-up dominates)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import HIGH, LEVELS, LOW, TINY_SFT, chat, config_from_params, write_params
from test_rl import PROTOCOL, TEST_RL

from rcgrpo_tasks.engine.compute import ComputeConfig
from rcgrpo_tasks.ops.config import ConfigError
from rcgrpo_tasks.ops.inputs import read_jsonl, read_tsv
from rcgrpo_tasks.ops.outputs import write_jsonl
from rcgrpo_tasks.train.common import distributed
from rcgrpo_tasks.train.rl import config as rl_config
from rcgrpo_tasks.train.rl import rollout as rl_rollout

HOOK = Path(__file__).parent / "multiproc"

# ------------------------------------------------------------------ the launcher


def test_a_stage_relaunches_only_with_several_processes_and_outside_a_launch(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert not distributed.should_launch(config_from_params(ComputeConfig, "compute"))
    assert distributed.should_launch(config_from_params(ComputeConfig, "compute", processes=2))
    monkeypatch.setenv("LOCAL_RANK", "1")  # inside torchrun / accelerate launch: never launch again
    assert not distributed.should_launch(config_from_params(ComputeConfig, "compute", processes=2))
    for bad in (0, True, "2"):
        with pytest.raises(ValueError, match="processes"):
            config_from_params(ComputeConfig, "compute", processes=bad)


def test_launch_command_reruns_the_same_stage_command(tmp_path):
    import torch

    options = {"init": "rctp", "algo": "rc_grpo", "adapter_dir": None, "out": Path("models/rl/x"), "params": "p.yaml"}
    argv = ["rl", *distributed.cli_options(options)]
    assert argv == ["rl", "--init", "rctp", "--algo", "rc_grpo", "--out", "models/rl/x", "--params", "p.yaml"]
    cmd = distributed.launch_command(config_from_params(ComputeConfig, "compute", processes=2), torch.device("cpu"), argv)
    assert cmd[:3] == [sys.executable, "-m", "accelerate.commands.launch"]
    assert cmd[cmd.index("--num_processes") + 1] == "2" and "--multi_gpu" in cmd
    assert cmd[cmd.index("--num_cpu_threads_per_process") + 1] == str(max(1, (os.cpu_count() or 1) // 2))
    assert cmd[cmd.index("-m", 3):] == ["-m", "rcgrpo_tasks.cli", *argv]
    cfg = tmp_path / "ds.yaml"
    cfg.write_text("distributed_type: DEEPSPEED\n")
    cmd = distributed.launch_command(config_from_params(ComputeConfig, "compute", processes=8, accelerate_config=str(cfg)), torch.device("cuda"), argv)
    assert cmd[cmd.index("--config_file") + 1] == str(cfg) and "--multi_gpu" not in cmd
    assert "--num_cpu_threads_per_process" not in cmd
    with pytest.raises(ConfigError, match="accelerate_config"):
        distributed.launch_command(config_from_params(ComputeConfig, "compute", processes=2, accelerate_config=str(tmp_path / "no.yaml")),
                                 torch.device("cpu"), argv)


def test_collectives_are_the_identity_in_one_process():
    assert distributed.gather({"a": 1}) == [{"a": 1}]
    assert distributed.any_process(True) and not distributed.any_process(False)


# ------------------------------------------------------------------ groups do not depend on the process


def _scripted_rollout(monkeypatch, draw="iid"):
    from rcgrpo_tasks.engine import rollout as engine

    seen = []

    def group(entry, reward_tokens, sampling):
        seen.append((entry.id, tuple(reward_tokens), sampling.seed))
        return [SimpleNamespace(entry_id=entry.id, reward_token=reward_tokens[i],
                                score={"paper_reward": float(reward_tokens[i] == HIGH), "valid": False,
                                       "partial_credit": 0.0}, token_ids=[1, 2, 3],
                                prompt_len=1, completion_mask=[0, 1, 1], logprobs=[0.0, -1.0, -1.0],
                                n_model_tokens=2, result=[], n_steps=1, messages=[], termination="stop")
                for i in range(len(reward_tokens))]

    monkeypatch.setattr(engine, "run_seeded_groups", lambda backend, groups, *a, **k: [group(*g) for g in groups])
    monkeypatch.setattr(rl_rollout.EngineRollout, "backend", lambda self, trainer: None)
    monkeypatch.setattr(rl_rollout, "task_of", lambda entry: SimpleNamespace(  # the entries are stand-ins
        failure_kind=lambda e, result, success: None if success else "no_call"))
    cfg = config_from_params(rl_config.RLConfig, "rl", **{**TEST_RL, "num_generations": 4, "batch_size": 16, "micro_batch_size": 4,
                                    "max_entries": None, "token_draw": draw})
    entries = {f"e{i}": SimpleNamespace(id=f"e{i}") for i in range(8)}
    tok = SimpleNamespace(eos_token_id=0)
    rollout = rl_rollout.EngineRollout(cfg, PROTOCOL, "rc", LEVELS, entries, tok)
    return rollout, seen


def _trainer(index: int, step: int = 3):
    return SimpleNamespace(state=SimpleNamespace(global_step=step), record_metric=lambda *a: None,
                           accelerator=SimpleNamespace(process_index=index, is_main_process=index == 0),
                           model=SimpleNamespace(training=True, eval=lambda: None, train=lambda mode: None))


@pytest.mark.parametrize("draw", ["iid", "stratified"])
def test_two_processes_roll_out_the_groups_one_process_would(monkeypatch, draw):
    rollout, seen = _scripted_rollout(monkeypatch, draw)
    batch = [f"e{i}" for i in range(4) for _ in range(4)]  # 4 groups of G=4
    one = rollout(batch, _trainer(0))
    single = list(seen)
    seen.clear()
    halves = [rollout(batch[:8], _trainer(0)), rollout(batch[8:], _trainer(1))]  # TRL's contiguous shares
    assert seen == single  # same entry, reward tokens and sampling seed for every group
    assert [t for h in halves for t in h["reward_token"]] == one["reward_token"]
    assert len({s for _, _, s in single}) == 4  # each group its own sampling seed
    seen.clear()
    rollout(batch, _trainer(0, step=4))
    assert [s for _, _, s in seen] != [s for _, _, s in single]  # and each step its own


# ------------------------------------------------------------------ two gloo processes vs one


def _stage(root: Path, argv: list[str], params: dict, name: str, check: bool = True,
           popen: bool = False, rule: str = "obedient") -> subprocess.CompletedProcess | subprocess.Popen:
    """`python -m rcgrpo_tasks.cli <argv>` as DVC runs a stage, with `params` and the scripted-reward hook
    (`rule`: tests/multiproc/sitecustomize.py)."""
    path = write_params(root / f"{name}.params.yaml", params)  # the committed params with `params` set
    env = {**os.environ, "PYTHONHASHSEED": "0", "RCGRPO_TEST_SCRIPTED_REWARDS": rule,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(HOOK), os.environ.get("PYTHONPATH")]))}
    env.pop("LOCAL_RANK", None)
    cmd = [sys.executable, "-m", "rcgrpo_tasks.cli", *argv, "--params", str(path)]
    if popen:
        return subprocess.Popen(cmd, env=env, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    res = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=600)
    if check:
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    return res


def _safetensors(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))


def _close_weights(a: dict, b: dict, init: dict | None = None) -> float:
    """Max |a - b| over the tensors both hold, required to be within 1 % of how far training moved them
    (Adam turns a float-noise difference of a near-zero gradient into a step of up to lr)."""
    diff = max(float((a[k] - b[k]).abs().max()) for k in a if k in b)
    moved = max(float((a[k] - init[k]).abs().max()) for k in a if k in init) if init else 0.0
    assert diff <= 0.01 * moved + 1e-6, (diff, moved)
    return diff


def _adam_close(a: dict, b: dict, lr: float) -> None:
    """Weights trained from the same init agree up to float noise: Adam turns the noise of a near-zero
    gradient into a step of up to lr, so a few elements may differ by up to 2 lr; on average they must
    agree to 1 % of lr and fewer than 2 % may differ by more than lr / 10."""
    import torch

    diffs = torch.cat([(a[k] - b[k]).abs().flatten() for k in a])
    assert set(a) == set(b)
    assert float(diffs.mean()) < 0.01 * lr and float((diffs > 0.1 * lr).float().mean()) < 0.02, \
        (float(diffs.mean()), float((diffs > 0.1 * lr).float().mean()))


RL_CELL = dict(num_generations=2, batch_size=4, max_steps=3, max_entries=4, save_steps=1)
"""Two groups of G=2 per step: one whole group per process with two processes."""


def _rl_params(processes_: int, micro: int) -> dict:
    # Importance sampling off: its token weights read the policy after step 1, whose Adam noise between the
    # two runs `_adam_close` allows, and turn it into loss differences of ~20 % of a ~1e-4 loss (the group's
    # advantages no longer cancel); the weights themselves are per token, so processes cannot change them
    # (test_rl_offpolicy.py checks them).
    return {"rl": {**TEST_RL, **RL_CELL, "micro_batch_size": micro, "categories": ["base"],
                   "importance_sampling": "off"},
            "prompt": {"system_prompt": "short"}, "label_rewards": {"tokens": list(LEVELS)},
            "compute": {"device": "cpu", "processes": processes_}}


def _rl_argv(root: Path, model_dir: Path, name: str, init: str = "rctp", algo: str = "rc_grpo") -> list[str]:
    return ["rl", "--init", init, "--algo", algo, "--model-dir", str(model_dir), "--entries",
            str(root / "entries.jsonl"), "--split", str(root / "split.json"), "--out", str(root / "out" / name),
            "--checkpoints", str(root / "ckpt" / name), "--metrics", str(root / "res" / f"{name}.json"),
            "--plots", str(root / "res" / f"{name}.tsv")]


@pytest.fixture(scope="module")
def rl_runs(rl_env):
    """The same RC-GRPO cell, 3 steps: one process at micro-batch 4 and two processes at micro-batch 2."""
    root, model_dir = rl_env
    # 4 train entries: two groups a step without repeating an entry within the step.
    entries = [json.loads(ln) for ln in (root / "entries.jsonl").read_text().splitlines()]
    split = json.loads((root / "split.json").read_text())
    assert len(split["train"]) >= 4 and len(entries) >= 4
    t0 = time.perf_counter()
    _stage(root, _rl_argv(root, model_dir, "one"), _rl_params(1, 4), "one")
    t1 = time.perf_counter()
    _stage(root, _rl_argv(root, model_dir, "two"), _rl_params(2, 2), "two")
    return root, model_dir, {"one_s": t1 - t0, "two_s": time.perf_counter() - t1}


def test_rl_on_two_processes_equals_one_process_at_twice_the_micro_batch(rl_runs):
    root, model_dir, seconds = rl_runs
    one, two = (read_jsonl(root / "ckpt" / n / "rollouts.jsonl") for n in ("one", "two"))
    assert len(one) == len(two) == 3 * 4
    fields = ("step", "group", "entry_id", "reward_token", "rewards", "tokens_sha1", "trained")
    assert [{k: r[k] for k in fields} for r in one] == [{k: r[k] for k in fields} for r in two]
    assert {r["reward_token"] for r in one} == {LOW, HIGH} and {r["rewards"]["paper_reward"] for r in one} == {0.0, 1.0}
    assert [r["advantage"] for r in one] == pytest.approx([r["advantage"] for r in two], abs=1e-5)
    assert any(abs(r["advantage"]) > 0.5 for r in one)
    d1, d2 = read_tsv(root / "res" / "one.tsv"), read_tsv(root / "res" / "two.tsv")
    assert [r["step"] for r in d1] == [r["step"] for r in d2] == [1, 2, 3]
    for col in ("reward", "reward_high", "reward_low", "frac_zero_std", "adv_abs_mean", "model_tokens",
                "rollouts_generated", "useful_groups"):  # every process's rollouts, not the main one's share
        assert [r[col] for r in d1] == pytest.approx([r[col] for r in d2], abs=1e-6, nan_ok=True), col
    for col in ("loss", "kl"):
        assert [r[col] for r in d1] == pytest.approx([r[col] for r in d2], rel=1e-3, abs=1e-6), col
    init = _safetensors(model_dir / "model.safetensors")
    _close_weights(_safetensors(root / "out" / "one" / "model.safetensors"),
                   _safetensors(root / "out" / "two" / "model.safetensors"), init)
    m1, m2 = (json.loads((root / "res" / f"{n}.json").read_text()) for n in ("one", "two"))
    assert (m1["micro_batch"], m2["micro_batch"]) == (4, 2) and m1["steps"] == m2["steps"] == 3
    print(f"rl: one process {seconds['one_s']:.1f} s, two processes {seconds['two_s']:.1f} s")


@pytest.mark.slow
def test_plain_grpo_on_two_processes_equals_one_process(rl_runs):
    """GRPO from the SFT init (no reward token; scripted rewards alternate within each group)."""
    root, model_dir, _ = rl_runs
    for name, n, micro in (("grpo-one", 1, 4), ("grpo-two", 2, 2)):
        _stage(root, _rl_argv(root, model_dir, name, "sft", "grpo"), _rl_params(n, micro), name)
    one, two = (read_jsonl(root / "ckpt" / n / "rollouts.jsonl") for n in ("grpo-one", "grpo-two"))
    fields = ("step", "group", "entry_id", "reward_token", "rewards", "tokens_sha1", "trained")
    assert [{k: r[k] for k in fields} for r in one] == [{k: r[k] for k in fields} for r in two]
    assert {r["reward_token"] for r in one} == {None}
    assert [r["advantage"] for r in one] == pytest.approx([r["advantage"] for r in two], abs=1e-5)
    d1, d2 = read_tsv(root / "res" / "grpo-one.tsv"), read_tsv(root / "res" / "grpo-two.tsv")
    assert [r["loss"] for r in d1] == pytest.approx([r["loss"] for r in d2], rel=1e-3, abs=1e-6)
    _close_weights(_safetensors(root / "out" / "grpo-one" / "model.safetensors"),
                   _safetensors(root / "out" / "grpo-two" / "model.safetensors"),
                   _safetensors(model_dir / "model.safetensors"))


@pytest.mark.slow
def test_dynamic_sampling_on_two_processes_refills_as_one_process_does(rl_runs):
    """Entries ending in an even digit are flat: dynamic sampling drops their groups and refills the slots
    with entries drawn for the whole batch, each process decoding its own slots."""
    root, model_dir, _ = rl_runs
    for name, n, micro in (("dyn-one", 1, 4), ("dyn-two", 2, 2)):
        _stage(root, _rl_argv(root, model_dir, name, "sft", "dynamic"), _rl_params(n, micro), name, rule="flat-even")
    one, two = (read_jsonl(root / "ckpt" / n / "rollouts.jsonl") for n in ("dyn-one", "dyn-two"))
    fields = ("step", "group", "entry_id", "reward_token", "rewards", "tokens_sha1", "trained")
    assert [{k: r[k] for k in fields} for r in one] == [{k: r[k] for k in fields} for r in two]
    assert [r["advantage"] for r in one] == pytest.approx([r["advantage"] for r in two], abs=1e-5)
    d1, d2 = read_tsv(root / "res" / "dyn-one.tsv"), read_tsv(root / "res" / "dyn-two.tsv")
    price = ("rollouts_generated", "rollouts_trained", "groups_dropped", "useful_groups", "gen_rounds",
             "gen_tokens_per_useful_group", "frac_zero_std_generated", "step_skipped")
    for col in price:
        assert [r[col] for r in d1] == pytest.approx([r[col] for r in d2], nan_ok=True), col
    assert sum(r["groups_dropped"] for r in d1) > 0  # refills happened
    _close_weights(_safetensors(root / "out" / "dyn-one" / "model.safetensors"),
                   _safetensors(root / "out" / "dyn-two" / "model.safetensors"),
                   _safetensors(model_dir / "model.safetensors"))


@pytest.mark.slow
def test_two_process_rl_stopped_by_sigterm_resumes_to_the_same_run(rl_runs):
    """SIGTERM to the stage while step 2 runs: every process finishes and checkpoints the same step, exit 143,
    nothing published; the rerun resumes from that checkpoint and ends where the uninterrupted run ended."""
    root, model_dir, _ = rl_runs
    ckpt = root / "ckpt" / "killed"
    proc = _stage(root, _rl_argv(root, model_dir, "killed"), _rl_params(2, 2), "killed", popen=True)
    deadline = time.monotonic() + 300
    while not (ckpt / "checkpoint-1" / "trainer_state.json").is_file():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-4000:] if proc.stdout else ""
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 143, out[-4000:]
    assert "SIGTERM received" in out and not (root / "out" / "killed").exists()
    stopped = sorted(int(p.name.split("-")[1]) for p in ckpt.glob("checkpoint-*"))
    assert stopped and stopped[-1] < 3, stopped  # it stopped early, on a checkpoint
    _stage(root, _rl_argv(root, model_dir, "killed"), _rl_params(2, 2), "killed")
    summary = json.loads((root / "res" / "killed.json").read_text())
    assert summary["resumed_from"].endswith(f"checkpoint-{stopped[-1]}") and summary["steps"] == 3
    ref, resumed = (read_jsonl(root / "ckpt" / n / "rollouts.jsonl") for n in ("two", "killed"))
    fields = ("step", "group", "entry_id", "reward_token", "rewards", "tokens_sha1")
    assert [{k: r[k] for k in fields} for r in resumed] == [{k: r[k] for k in fields} for r in ref]
    _close_weights(_safetensors(root / "out" / "two" / "model.safetensors"),
                   _safetensors(root / "out" / "killed" / "model.safetensors"),
                   _safetensors(model_dir / "model.safetensors"))
    print(f"resumed from checkpoint-{stopped[-1]}")


def test_sft_on_two_processes_equals_one_process_at_twice_the_micro_batch(tmp_path, tiny_model_dir):
    write_jsonl(tmp_path / "rctp.jsonl", [chat(i, HIGH if i % 2 else LOW) for i in range(16)])

    def params(n: int, micro: int) -> dict:
        sft = {**TINY_SFT, "max_steps": 3, "batch_size": micro, "grad_accum": 1, "variants": {"rctp": {}}}
        return {"sft": sft, "label_rewards": {"tokens": list(LEVELS)}, "compute": {"device": "cpu", "processes": n}}

    def argv(name: str) -> list[str]:
        return ["sft", "--variant", "rctp", "--model-dir", str(tiny_model_dir), "--data", str(tmp_path / "rctp.jsonl"),
                "--out", str(tmp_path / "out" / name), "--checkpoints", str(tmp_path / "ckpt" / name),
                "--metrics", str(tmp_path / f"{name}.json"), "--plots", str(tmp_path / f"{name}.tsv")]

    env = {"MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db", "MLFLOW_ARTIFACT_ROOT": str(tmp_path / "art")}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        t0 = time.perf_counter()
        _stage(tmp_path, argv("one"), params(1, 4), "one")
        t1 = time.perf_counter()
        _stage(tmp_path, argv("two"), params(2, 2), "two")
        t2 = time.perf_counter()
    l1, l2 = read_tsv(tmp_path / "one.tsv"), read_tsv(tmp_path / "two.tsv")
    assert [r["step"] for r in l1] == [r["step"] for r in l2] == [1, 2, 3]
    assert [r["loss"] for r in l1] == pytest.approx([r["loss"] for r in l2], rel=1e-4)
    assert l1[-1]["loss"] < l1[0]["loss"]
    _adam_close(_safetensors(tmp_path / "out" / "one" / "adapter_model.safetensors"),
                _safetensors(tmp_path / "out" / "two" / "adapter_model.safetensors"), TINY_SFT["learning_rate"])
    m1, m2 = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "two"))
    assert (m1["micro_batch"], m2["micro_batch"]) == (4, 2)
    print(f"sft: one process {t1 - t0:.1f} s, two processes {t2 - t1:.1f} s")
