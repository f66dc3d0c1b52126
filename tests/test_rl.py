"""rl stage: TRL GRPOTrainer + the real rollout engine on a tiny random model (two steps per mode),
env-token masking through TRL's own loss, the CPU log-prob fast path, resume, and bad params."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from helpers import (
    HIGH,
    LEVELS,
    assert_same_adam_step,
    capture_trainer,
    compute_from_params,
    config_from_params,
    device_under_test,
    grad_capture,
    on_test_device,
    pack_spy,
    resolved,
    snapshot,
    write_params,
)

from rcgrpo import group_metrics
from rcgrpo_tasks.env.prompt import PromptConfig
from rcgrpo_tasks.ops.config import ConfigError, load_config
from rcgrpo_tasks.ops.inputs import read_tsv
from rcgrpo_tasks.stages import rl as rl_stage
from rcgrpo_tasks.train.common import callbacks, checkpoints
from rcgrpo_tasks.train.rl import config as rl_config
from rcgrpo_tasks.train.rl import rollout_policy
from rcgrpo_tasks.train.rl import run as rl_run
from rcgrpo_tasks.train.rl import trainer as rl_trainer

# Small enough for seconds per step on 2 cores; G=2 and one entry per step.
TEST_RL = dict(num_generations=2, batch_size=2, micro_batch_size=2, max_steps=2, learning_rate=5e-3, beta=0.1,
               max_new_tokens=6, max_outputs=2, categories=["base"], max_entries=2,
               lora_r=4, lora_alpha=8, save_steps=1, bf16=False, temperature=1.0, dynamic_max_rounds=3,
               pool_band=None, probe_entries=0)  # the probe's own tests: tests/test_probe.py
PROTOCOL = config_from_params(PromptConfig, "prompt", system_prompt="short").protocol_config(TEST_RL["max_outputs"])


def _spec(root: Path, model_dir: Path, name: str, init: str, algo: str) -> rl_trainer.RLRun:
    return rl_trainer.RLRun(init=init, algo=algo, model_dir=model_dir, adapter_dir=None, entries=root / "entries.jsonl",
                      split=root / "split.json", out=root / "out" / name, checkpoints=root / "ckpt" / name,
                      metrics=root / "res" / name / "metrics.json", plots=root / "res" / name / "diag.tsv")


@pytest.fixture
def scripted_rewards(monkeypatch):
    """A random tiny model never succeeds, so every group would be zero-std and nothing would move. Keep
    the real engine and scorer, then overwrite the paper reward with a rule: an "obedient" conditioned
    policy (high -> 1, low -> 0) and, without a split by token, alternating success within the group."""
    from rcgrpo_tasks.engine import rollout as engine

    real, calls = engine.run_seeded_groups, []

    def run_seeded_groups(backend, groups, protocol_cfg, provenance=None):
        out = real(backend, groups, protocol_cfg, provenance)
        for (_, tokens, _), trajs in zip(groups, out):
            mixed = len(set(tokens)) > 1
            for i, t in enumerate(trajs):
                r = float(t.reward_token == HIGH) if mixed else float(i % 2 == 0)
                t.score = {**t.score, "paper_reward": r}
            calls.append(trajs)
        return out

    monkeypatch.setattr(engine, "run_seeded_groups", run_seeded_groups)
    return calls


def _weights(path):
    from safetensors.torch import load_file

    return load_file(str(Path(path) / "model.safetensors"))


@pytest.mark.parametrize("init,algo,mode", [("rctp", "rc_grpo", "rc"), ("rctp", "grpo", "fixed"),
                                            ("sft", "grpo", "none"), ("rctp", "rc_anchor", "rc")])
def test_two_rl_steps_per_mode(rl_env, scripted_rewards, monkeypatch, init, algo, mode):
    import mlflow

    root, model_dir = rl_env
    cfg = config_from_params(rl_config.RLConfig, "rl", **{**TEST_RL, "categories": ("base",)})
    spec = _spec(root, model_dir, f"{init}-{algo}", init, algo)
    box = capture_trainer(monkeypatch)
    summary = rl_run.train_rl(cfg, PROTOCOL, LEVELS, spec, compute=compute_from_params())

    assert spec.mode == mode and summary["conditioning"] == mode
    assert summary["steps"] == 2 and math.isfinite(summary["train_loss"])
    # Parameters changed: the merged policy differs from the init weights.
    before, after = _weights(model_dir), _weights(spec.out)
    changed = [k for k in before if k in after and not before[k].equal(after[k])]
    assert changed and any("q_proj" in k for k in changed)
    assert (spec.out / "rl_adapter" / "adapter_config.json").is_file()
    # Rollouts were conditioned as the mode says, and the token is inside each rollout's prompt ids.
    trajs = [t for group in scripted_rewards for t in group]
    tokens = {t.reward_token for t in trajs}
    assert tokens <= ({None} if mode == "none" else {HIGH} if mode == "fixed" else set(LEVELS))
    tok_ids = {t: box["trainer"].processing_class.convert_tokens_to_ids(t) for t in LEVELS}
    for t in trajs:
        prompt = t.token_ids[: t.prompt_len]
        assert all((tid in prompt) == (t.reward_token == tok) for tok, tid in tok_ids.items())
        assert sum(t.completion_mask[t.prompt_len:]) == t.n_model_tokens  # env_mask = the engine's mask
    # TRL's advantages are exactly the whole-group advantages of the rewards (RC-GRPO's, in `rc`).
    last = scripted_rewards[-1]
    if algo == "rc_anchor":  # each rollout's KL coefficient rode with TRL's buffered batch: beta_low on the low ones
        from rcgrpo_tasks.train.rl.anchor import KL_COEF

        coefs = [float(c) for b in box["trainer"]._buffered_inputs for c in b[KL_COEF]]
        assert sorted(coefs) == sorted(cfg.beta_low if t.reward_token == LEVELS[0] else cfg.beta for t in last)
    expected = group_metrics.group_advantages([t.score["paper_reward"] for t in last], cfg.num_generations)
    assert list(box["trainer"].last_generation.advantages) == pytest.approx(expected, abs=1e-4)
    # Diagnostics: TSV (dvc plots) + summary + MLflow, every step.
    rows = read_tsv(spec.plots)
    assert [r["step"] for r in rows] == [1, 2]
    for col in ("reward", "frac_zero_std", "adv_abs_mean", "adv_std", "kl", "clip_ratio", "model_tokens", "n_calls",
                "env_errors", "rollout_tokens_per_s", "step_time", "reward_official", "reward_partial"):
        assert all(not math.isnan(r[col]) for r in rows), col
    if mode == "rc":
        assert all(r["reward_high"] >= r["reward_low"] for r in rows if not math.isnan(r["controllability_gap"]))
    metrics = json.loads(spec.metrics.read_text())
    assert metrics["steps"] == 2 and metrics["mean_frac_zero_std"] is not None
    # The mechanism's parts: every rollout's token level and failure kind, the rollouts with a signal.
    assert sum(c["rollouts"] for c in metrics["failures"].values()) == len(trajs)
    assert sum(metrics["nonzero_adv"].values()) == sum(sum(g["nonzero_adv"].values()) for g in metrics["groups"])
    assert all(any(not math.isnan(r[f"nonzero_adv_{lv}"]) for lv in ("high", "low", "none")) for r in rows)
    # The mechanism with CIs over steps, and where it ran (`compute.device: auto`: the device under test).
    zero = metrics["mechanism"]["frac_zero_std"]
    assert zero["steps"] == 2 and zero["ci_low"] <= zero["mean"] <= zero["ci_high"]
    assert zero["mean"] == pytest.approx(metrics["mean_frac_zero_std"])
    gap = metrics["mechanism"]["controllability_gap"]
    assert (gap["steps"] > 0) == (mode == "rc")  # one token only under GRPO: no gap
    assert on_test_device(metrics["placement"]["device"]) and metrics["micro_batch"] == cfg.micro_batch_size
    client = mlflow.MlflowClient()
    run = mlflow.search_runs(experiment_names=["test-rl"], filter_string=f"tags.`rl.algo` = '{algo}' and "
                             f"tags.`rl.init` = '{init}'", output_format="list")[0]
    assert on_test_device(run.data.params["placement.device"]) and run.data.params["compute.device"] == "auto"
    history = client.get_metric_history(run.info.run_id, "rc/frac_zero_std")
    assert sorted(m.step for m in history) == [1, 2]
    assert client.get_metric_history(run.info.run_id, "kl") and client.get_metric_history(run.info.run_id, "step_time")


def test_env_tokens_carry_no_loss_and_cpu_logps_match_trl(rl_env):
    """Through TRL's own `_compute_loss`: garbage reference/old log-probs at env positions change nothing."""
    import torch
    from trl import GRPOTrainer

    root, model_dir = rl_env
    cfg = config_from_params(rl_config.RLConfig, "rl", **{**TEST_RL, "categories": ("base",)})
    trainer = rl_trainer.build_trainer(resolved(cfg, torch.device("cpu")), PROTOCOL, LEVELS, _spec(root, model_dir, "mask", "rctp", "rc_grpo"),
                                            track=False, device=torch.device("cpu"))  # the CPU fast path
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    g = torch.Generator().manual_seed(0)
    b, p, c = 2, 7, 9
    env = torch.tensor([[1, 1, 1, 0, 0, 0, 1, 1, 1], [1, 1, 0, 0, 1, 1, 1, 1, 1]])
    inputs = {"prompt_ids": torch.randint(0, 1000, (b, p), generator=g),
              "prompt_mask": torch.ones(b, p, dtype=torch.long),
              "completion_ids": torch.randint(0, 1000, (b, c), generator=g),
              "completion_mask": torch.ones(b, c, dtype=torch.long), "tool_mask": env,
              "advantages": torch.tensor([1.0, -1.0]), "num_items_in_batch": env.sum()}
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        mine, ent, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, c, compute_entropy=True)
        theirs, ent2, _ = GRPOTrainer._get_per_token_logps_and_entropies(trainer, trainer.model, ids, mask, c,
                                                                         compute_entropy=True)
    assert mine.shape == (b, c) and torch.allclose(mine, theirs, atol=1e-4) and torch.allclose(ent, ent2, atol=1e-3)

    def loss(ref, old):
        with torch.no_grad():
            return trainer._compute_loss(trainer.model, {**inputs, "ref_per_token_logps": ref,
                                                         "old_per_token_logps": old}).item()

    base = loss(mine - 0.3, mine - 0.1)
    junk_ref, junk_old = (mine - 0.3).clone(), (mine - 0.1).clone()
    junk_ref[env == 0] += 5.0  # large enough to dominate the loss if counted, finite under exp()
    junk_old[env == 0] -= 5.0
    assert math.isfinite(base) and loss(junk_ref, junk_old) == pytest.approx(base, abs=1e-6)
    model_pos = (env == 1)
    junk_ref[model_pos] += 1.0  # the same perturbation on model tokens does change the loss
    assert loss(junk_ref, junk_old) != pytest.approx(base, abs=1e-4)


def test_killed_run_resumes_from_last_checkpoint(rl_env, scripted_rewards):
    from transformers import TrainerCallback

    root, model_dir = rl_env
    cfg = config_from_params(rl_config.RLConfig, "rl", **{**TEST_RL, "categories": ("base",), "keep_checkpoints": True})
    spec = _spec(root, model_dir, "resume", "rctp", "rc_grpo")
    shutil.rmtree(spec.checkpoints, ignore_errors=True)

    class Kill(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            if state.global_step == 1:
                raise KeyboardInterrupt("simulated kill after checkpoint-1")

    with pytest.raises(KeyboardInterrupt):
        rl_run.train_rl(cfg, PROTOCOL, LEVELS, spec, callbacks=[Kill()], compute=compute_from_params())
    assert (spec.checkpoints / "checkpoint-1").is_dir() and not spec.out.exists()
    n_before = len(scripted_rewards)
    summary = rl_run.train_rl(cfg, PROTOCOL, LEVELS, spec, compute=compute_from_params())
    assert summary["resumed_from"].endswith("checkpoint-1")
    assert len(scripted_rewards) - n_before == 1  # only step 2 was rolled out again
    assert [r["step"] for r in read_tsv(spec.plots)] == [1, 2]
    state = json.loads((spec.checkpoints / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["global_step"] == 2 and spec.out.is_dir()
    # Other params: the stale checkpoints are discarded, training starts over.
    cfg2 = config_from_params(rl_config.RLConfig, "rl", **{**TEST_RL, "categories": ("base",), "max_steps": 1, "learning_rate": 1e-3})
    assert rl_run.train_rl(cfg2, PROTOCOL, LEVELS, spec, compute=compute_from_params())["resumed_from"] is None
    # keep_checkpoints false (the default): after success the folder holds its fingerprint and the run's
    # rollout log only (no checkpoint), as sft's its fingerprint
    left = sorted(p.name for p in spec.checkpoints.iterdir())
    assert left == sorted([checkpoints.FINGERPRINT_FILE, "rollouts.jsonl"]) and spec.out.is_dir()


def test_a_finished_run_rerun_is_restored_not_trained_a_step_further(rl_env, scripted_rewards):
    """DVC reruns a stage whose code changed; with the same fingerprint its last checkpoint is the finished
    run's. The Trainer resumed there would train one step past max_steps: the run is restored instead."""
    root, model_dir = rl_env
    cfg = config_from_params(rl_config.RLConfig, "rl", **{**TEST_RL, "categories": ("base",), "max_steps": 1, "keep_checkpoints": True})
    spec = _spec(root, model_dir, "finished", "rctp", "rc_grpo")
    shutil.rmtree(spec.checkpoints, ignore_errors=True)
    first = rl_run.train_rl(cfg, PROTOCOL, LEVELS, spec, compute=compute_from_params())
    weights = _weights(spec.out)
    n_rollouts = len(scripted_rewards)
    again = rl_run.train_rl(cfg, PROTOCOL, LEVELS, spec, compute=compute_from_params())
    assert again["resumed_from"].endswith("checkpoint-1") and again["steps"] == first["steps"] == 1
    assert len(scripted_rewards) == n_rollouts  # nothing rolled out
    assert not (spec.checkpoints / "checkpoint-2").exists()
    assert all(weights[k].equal(v) for k, v in _weights(spec.out).items())
    provenance = json.loads((spec.out / rl_trainer.MODEL_META_FILE).read_text())
    assert provenance["steps"] == 1


def test_sigterm_checkpoints_the_step_and_the_rerun_replays_it(rl_env, scripted_rewards):
    """SIGTERM during step 1 (dvc / Prefect cancel): step 1 is finished and checkpointed off the save_steps
    grid, nothing is written, exit status 143, the MLflow run KILLED; the re-run resumes at step 2 and its
    MLflow run holds both steps (step 1 replayed from the checkpoint's log history)."""
    import os
    import signal

    import mlflow
    from transformers import TrainerCallback

    class Term(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 0:
                os.kill(os.getpid(), signal.SIGTERM)

    root, model_dir = rl_env
    cfg = config_from_params(rl_config.RLConfig, "rl", **{**TEST_RL, "categories": ("base",), "save_steps": 2})
    spec = _spec(root, model_dir, "sigterm", "sft", "rc_grpo")
    with pytest.raises(callbacks.Interrupted) as info:
        rl_run.train_rl(cfg, PROTOCOL, LEVELS, spec, callbacks=[Term()], compute=compute_from_params())
    assert info.value.code == 143 and not spec.out.exists() and not spec.metrics.exists()
    assert sorted(p.name for p in spec.checkpoints.glob("checkpoint-*")) == ["checkpoint-1"]
    summary = rl_run.train_rl(cfg, PROTOCOL, LEVELS, spec, compute=compute_from_params())
    assert summary["resumed_from"].endswith("checkpoint-1") and summary["steps"] == 2
    done, killed = mlflow.search_runs(experiment_names=["test-rl"], filter_string="tags.`rl.init` = 'sft' and "
                                      "tags.`rl.algo` = 'rc_grpo'", order_by=["start_time DESC"], output_format="list")
    assert (done.info.status, killed.info.status) == ("FINISHED", "KILLED")
    history = mlflow.MlflowClient().get_metric_history(done.info.run_id, "diag/reward")
    assert sorted(m.step for m in history) == [1, 2]


def test_reference_is_the_init_model(rl_env):
    """KL anchor = the SFT/RCTP init (adapter merged), not the raw base: LoRA (adapter off) and full FT."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root, model_dir = rl_env
    adapter_dir = root / "init_adapter"
    torch.manual_seed(1)
    init = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir),
                          LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    init.save_pretrained(adapter_dir)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(adapter_dir)
    ids = torch.randint(0, 1000, (1, 12))
    with torch.no_grad():  # on the CPU; the trainer's models on the device under test
        expected = init.merge_and_unload()(ids).logits
        base = AutoModelForCausalLM.from_pretrained(model_dir)(ids).logits
    assert not torch.allclose(expected, base, atol=1e-4)  # the adapter matters
    device = device_under_test()
    spec = rl_trainer.RLRun(**{**_spec(root, model_dir, "ref", "rctp", "grpo").__dict__, "adapter_dir": adapter_dir})
    for full in (False, True):
        cfg = config_from_params(rl_config.RLConfig, "rl", **{**TEST_RL, "categories": ("base",), "full_finetune": full})
        trainer = rl_trainer.build_trainer(resolved(cfg), PROTOCOL, LEVELS, spec, track=False)
        assert on_test_device(trainer.accelerator.device)
        on_device = ids.to(trainer.accelerator.device)
        with torch.no_grad():
            if full:
                ref = trainer.ref_model(on_device).logits
            else:
                with trainer.model.disable_adapter():
                    ref = trainer.model(on_device).logits
        assert torch.allclose(ref.cpu(), expected, atol=1e-4), full
        if not full:  # the rollout snapshot = the live policy (LoRA merged), here after a fake update
            live = trainer.accelerator.unwrap_model(trainer.model)
            for name, prm in live.named_parameters():
                if "lora_B" in name:
                    prm.data.normal_(0, 0.05)
            snap = rollout_policy.policy_snapshot(live, torch.float32)
            for name, prm in live.named_parameters():  # refreshed in place on the next call
                if "lora_B" in name:
                    prm.data.normal_(0, 0.05)
            assert rollout_policy.policy_snapshot(live, torch.float32, snap) is snap
            assert next(snap.parameters()).device == next(live.parameters()).device  # on the policy's device
            with torch.no_grad():
                live_logits, snap_logits = live(on_device).logits, snap(on_device).logits
            assert not torch.allclose(live_logits.cpu(), expected, atol=1e-3)
            assert torch.allclose(snap_logits, live_logits, atol=1e-4)
            # a CPU copy decodes with the engine's CPU attention; the training model's config is untouched
            assert (snap.config._attn_implementation == "rcgrpo_cpu") == (device.type == "cpu")
            assert live.get_base_model().config._attn_implementation != "rcgrpo_cpu"


@pytest.mark.parametrize("override,match", [
    ({"num_generations": 1}, "num_generations .G. must be >= 2"),
    ({"p_high": 0.0}, "p_high must be in \\(0, 1\\)"),
    ({"p_high": 1.5}, "p_high must be in \\(0, 1\\)"),
    ({"batch_size": 6, "num_generations": 4, "micro_batch_size": 2}, "multiple of num_generations"),
    ({"batch_size": 8, "micro_batch_size": 3}, "multiple of micro_batch_size"),
    ({"typo_key": 1}, "unknown key"),
])
def test_bad_params_fail_before_training(tmp_path, override, match):
    from typer.testing import CliRunner

    params = tmp_path / "params.yaml"
    write_params(params, {"rl": {**TEST_RL, **override}})
    with pytest.raises(ConfigError, match=match):
        load_config(rl_config.RLConfig, params, "rl")
    res = CliRunner().invoke(rl_stage.app, ["--init", "rctp", "--algo", "rc_grpo", "--out", str(tmp_path / "o"),
                                      "--checkpoints", str(tmp_path / "c"), "--params", str(params)])
    assert res.exit_code == 2 and "rl:" in res.output
    assert not (tmp_path / "c").exists() and not (tmp_path / "o").exists()


def test_cuda_without_cuda_fails_before_training(rl_env, tmp_path, monkeypatch):
    import torch
    from typer.testing import CliRunner

    root, model_dir = rl_env
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    params = tmp_path / "params.yaml"
    write_params(params, {"rl": TEST_RL, "prompt": {"system_prompt": "short"},
                          "label_rewards": {"tokens": list(LEVELS)}, "compute": {"device": "cuda"}})
    res = CliRunner().invoke(rl_stage.app, ["--init", "rctp", "--algo", "rc_grpo", "--model-dir", str(model_dir),
                                      "--entries", str(root / "entries.jsonl"), "--split", str(root / "split.json"),
                                      "--out", str(tmp_path / "o"), "--checkpoints", str(tmp_path / "c"),
                                      "--params", str(params)])
    assert res.exit_code == 2 and "CUDA is not available" in res.output
    assert not (tmp_path / "c").exists() and not (tmp_path / "o").exists()


def test_fitted_micro_batch_keeps_the_generation_batch_and_the_run(rl_env):
    """What `fit_micro_batch` retries with: half the micro-batch, twice the accumulation, the same rollouts
    per step, on the CPU asked for (the run's fingerprint is `train_rl`'s, of the requested config: a fitted
    micro-batch resumes the same run)."""
    import torch

    root, model_dir = rl_env
    cfg = config_from_params(rl_config.RLConfig, "rl", **{**TEST_RL, "categories": ("base",)})
    spec = _spec(root, model_dir, "fit", "rctp", "rc_grpo")
    for micro in (None, 1):
        trainer = rl_trainer.build_trainer(resolved(cfg, torch.device("cpu")), PROTOCOL, LEVELS, spec, track=False,
                                           device=torch.device("cpu"), micro_batch=micro)
        args = trainer.args
        assert args.use_cpu and args.generation_batch_size == cfg.batch_size
        assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == ((2, 1) if micro is None else (1, 2))


@pytest.mark.gpu
def test_rollout_snapshot_lives_on_the_gpu(tiny_model_dir):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    policy = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir).cuda(),
                            LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    snap = rollout_policy.policy_snapshot(policy, torch.bfloat16)
    assert {p.device.type for p in snap.parameters()} == {"cuda"} and next(snap.parameters()).dtype == torch.bfloat16
    assert snap.config._attn_implementation != "rcgrpo_cpu"  # the CPU decode attention stays on the CPU
    ids = torch.randint(0, 1000, (1, 12), device="cuda")
    with torch.no_grad():
        ref = policy(ids).logits.float()
        torch.testing.assert_close(snap(ids).logits.float(), ref, atol=0.1, rtol=0.05)  # bf16 rounding


def test_world_size_must_keep_groups_whole():
    cfg = config_from_params(rl_config.RLConfig, "rl", num_generations=5, batch_size=20, micro_batch_size=5)
    assert [rl_config.check_world(cfg, w) for w in (1, 2, 4)] == [4, 2, 1]  # gradient-accumulation steps
    for world in (3, 8):
        with pytest.raises(ConfigError, match="whole groups"):
            rl_config.check_world(cfg, world)


def test_vllm_backends_over_trl_engines_without_vllm(tiny_model_dir):
    """The GPU path's engine backends, built as `rollout_policy.trl_vllm_backend` builds them (no vLLM here):
    colocate wraps TRL's engine through the constructor; server mode sends one request per length cap
    (concurrently) and detects the stop token."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from rcgrpo_tasks.engine.backend import SamplingParams
    from rcgrpo_tasks.engine.vllm import VLLMBackend, VLLMServerBackend

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    llm = SimpleNamespace(llm_engine=SimpleNamespace(model_config=SimpleNamespace(max_model_len=4096)))
    colocate = VLLMBackend.from_llm(llm, tok, model="<trl colocate>")
    assert colocate.llm is llm and colocate.max_positions == 4096 and colocate.lora is None
    assert colocate.describe() == {"backend": "vllm", "model": "<trl colocate>", "adapter": None}

    calls, body = [], tok.encode("get done", add_special_tokens=False)[:2]

    class Client:  # TRL's VLLMClient.generate interface
        def generate(self, prompts, n, temperature, top_p, max_tokens, logprobs, generation_kwargs=None):
            calls.append((prompts, max_tokens))
            ids = [*body, tok.eos_token_id][:max_tokens]
            return {"completion_ids": [ids], "logprobs": [[[-0.5]] * len(ids)]}

    server = VLLMServerBackend(Client(), tok, max_positions=128)
    out = server.session().generate(["a", "b"], [[1, 2], [3]], SamplingParams(max_new_tokens=3), max_new_tokens=[3, 2])
    assert sorted(calls) == [([[1, 2]], 3), ([[3]], 2)]  # one request per cap, sent concurrently
    assert [c.finish_reason for c in out] == ["stop", "length"]
    assert out[0].logprobs == [-0.5] * 3 and out[0].text == tok.decode(body) == out[1].text != ""


def test_an_rl_step_updates_the_same_weights_with_and_without_the_shared_prefix(rl_env, scripted_rewards, monkeypatch):
    """One RC-GRPO step (2 groups of G=2 in one micro-batch, both tokens, reference on) from the same seed on the
    CPU, float32: the same rollouts, the step's gradients within 1e-5 of the largest, the updated adapter within
    1e-3 of the step wherever Adam's step does not amplify a gradient's rounding (`helpers.assert_same_adam_step`),
    and both runs wrote a model that moved."""
    from rcgrpo_tasks.engine.compute import ComputeConfig

    packed = pack_spy(monkeypatch)
    root, model_dir = rl_env
    out = {}
    for name, shared in (("plain", None), ("shared", 0)):
        cfg = config_from_params(rl_config.RLConfig, "rl", **{**TEST_RL, "categories": ("base",), "max_steps": 1, "batch_size": 4,
                                        "micro_batch_size": 4, "shared_prefix_min_tokens": shared, "rollout_dtype": "live"})
        spec = _spec(root, model_dir, f"sp-{name}", "rctp", "rc_grpo")
        snap, grads = snapshot(), grad_capture()
        rl_run.train_rl(cfg, PROTOCOL, LEVELS, spec, callbacks=[snap, grads], track=False, compute=config_from_params(ComputeConfig, "compute", device="cpu"))
        out[name] = (snap, grads.grads, _weights(spec.out), [t.token_ids for g in scripted_rewards[-2:] for t in g])
        assert bool(packed) == (shared is not None)  # policy, reference and trainer forwards: the shared layout
    (s_plain, g_plain, w_plain, r_plain), (s_shared, g_shared, w_shared, r_shared) = out["plain"], out["shared"]
    assert r_plain == r_shared
    assert_same_adam_step(s_plain, s_shared, g_plain, g_shared)
    before = _weights(model_dir)
    for w in (w_plain, w_shared):
        assert max(float((w[k] - before[k]).abs().max()) for k in w if k in before) > 0


def test_one_far_off_token_cannot_dominate_the_kl_term(rl_env):
    """Through TRL's `_compute_loss`: one sampled token the reference finds nearly certain and the policy
    ~11 nat less likely (the collapse seen outside the default) gives TRL's k3 ~ 5e4; with `kl_token_max`
    that token's KL is the bound, and tokens inside it are TRL's exactly."""
    import torch

    root, model_dir = rl_env
    g = torch.Generator().manual_seed(0)
    b, p, c = 2, 7, 5
    inputs = {"prompt_ids": torch.randint(0, 1000, (b, p), generator=g), "prompt_mask": torch.ones(b, p, dtype=torch.long),
              "completion_ids": torch.randint(0, 1000, (b, c), generator=g),
              "completion_mask": torch.ones(b, c, dtype=torch.long), "advantages": torch.tensor([0.0, 0.0]),
              "num_items_in_batch": torch.tensor(b * c)}
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    out = {}
    for bound in (None, 10.0):
        cfg = config_from_params(rl_config.RLConfig, "rl", **{**TEST_RL, "categories": ("base",), "kl_token_max": bound})
        trainer = rl_trainer.build_trainer(resolved(cfg, torch.device("cpu")), PROTOCOL, LEVELS, _spec(root, model_dir, "kl", "rctp", "rc_grpo"),
                                                   track=False, device=torch.device("cpu"))
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1
        with torch.no_grad():
            mine, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, torch.ones_like(ids), c)
        near, far = mine - 0.05, (mine - 0.05).clone()
        far[0, 2] = -0.01
        trainer._metrics["train"].clear()
        with torch.no_grad():
            loss_near = trainer._compute_loss(trainer.model, {**inputs, "ref_per_token_logps": near}).item()
            loss_far = trainer._compute_loss(trainer.model, {**inputs, "ref_per_token_logps": far}).item()
        out[bound] = (loss_near, loss_far, trainer._metrics["train"]["kl"][-1])
        assert far[0, 2].item() == pytest.approx(-0.01)  # the caller's tensor is not touched
    (near0, far0, _), (near1, far1, kl1) = out[None], out[10.0]
    assert near1 == pytest.approx(near0, rel=1e-6)  # inside the bound: TRL's loss
    assert far1 < 2.0 < 100.0 < far0 and kl1 <= 10.0 / (b * c) + 0.01


def test_a_diverging_run_stops_names_the_step_and_rolls_back(rl_env, scripted_rewards):
    """A learning rate that diverges on the tiny model: the run stops at the step whose KL crosses
    `divergence_kl`, says so, tags its MLflow run, and its policy is the last good checkpoint's."""
    import mlflow
    import torch

    from rcgrpo_tasks.engine.compute import ComputeConfig

    root, model_dir = rl_env
    cfg = config_from_params(rl_config.RLConfig, "rl", **{**TEST_RL, "categories": ("base",), "learning_rate": 3.0, "max_steps": 8,
                                    "divergence_kl": 0.05, "keep_checkpoints": True})
    spec = _spec(root, model_dir, "diverge", "rctp", "rc_grpo")
    summary = rl_run.train_rl(cfg, PROTOCOL, LEVELS, spec, compute=config_from_params(ComputeConfig, "compute", device="cpu"))
    event = summary["diverged"]
    assert event is not None and f"step {event['step']}: mean KL" in event["reason"], summary
    assert summary["steps"] == event["step"] < 8 and event["restored_step"] <= event["step"] - 2
    rows = read_tsv(spec.plots)
    assert rows[-1]["kl"] > 0.05 and all(r["kl"] <= 0.05 for r in rows[:-1])
    policy = _weights(spec.out)
    if event["restored_step"] == 0:  # rolled back to the init: the merged policy is the init model
        init = _weights(model_dir)
        assert all(torch.allclose(policy[k], init[k], atol=1e-6) for k in init if k in policy)
    run = mlflow.search_runs(experiment_names=["test-rl"], filter_string="tags.`rl.diverged` != ''",
                             output_format="list")
    assert run and run[0].data.tags["rl.restored_step"] == str(event["restored_step"])


def test_a_nonfinite_gradient_skips_its_update_and_the_run_goes_on(rl_env, scripted_rewards):
    """A NaN in one step's gradient (injected through a hook on one LoRA weight): that update is skipped
    (`kl_guard.drop_nonfinite_grads`), the step is listed in the summary, no weight of the policy is NaN and
    the run trains to its last step."""
    import torch
    from transformers import TrainerCallback

    from rcgrpo_tasks.engine.compute import ComputeConfig

    class PoisonStep(TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kwargs):
            if state.global_step == 1:  # the second update
                param = next(p for n, p in model.named_parameters() if p.requires_grad and "lora_A" in n)
                handle = []
                handle.append(param.register_hook(lambda g: (handle.pop().remove(), g * float("nan"))[1]))

    root, model_dir = rl_env
    cfg = config_from_params(rl_config.RLConfig, "rl", **{**TEST_RL, "categories": ("base",), "max_steps": 3})
    spec = _spec(root, model_dir, "nonfinite", "rctp", "rc_grpo")
    summary = rl_run.train_rl(cfg, PROTOCOL, LEVELS, spec, callbacks=[PoisonStep()], compute=config_from_params(ComputeConfig, "compute", device="cpu"))
    assert summary.get("nonfinite_grad_steps") == [2] and summary["steps"] == 3 and summary["diverged"] is None
    assert all(torch.isfinite(w).all() for w in _weights(spec.out).values())
    rows = read_tsv(spec.plots)
    assert all(math.isfinite(r["loss"]) for r in rows)


def test_drop_nonfinite_grads_leaves_the_weights_and_the_moments_alone():
    import torch

    from rcgrpo_tasks.train.rl.kl_guard import drop_nonfinite_grads

    layer = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(layer.parameters(), lr=0.1)
    layer(torch.ones(1, 3)).sum().backward()
    assert not drop_nonfinite_grads(opt) and layer.weight.grad is not None
    opt.step()
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    moments = opt.state[layer.weight]["exp_avg"].clone()
    opt.zero_grad()
    (layer(torch.ones(1, 3)).sum() * float("nan")).backward()
    assert drop_nonfinite_grads(opt) and layer.weight.grad is None and layer.bias.grad is None
    opt.step()
    assert all(torch.equal(before[k], v) for k, v in layer.state_dict().items())
    assert torch.equal(opt.state[layer.weight]["exp_avg"], moments)
