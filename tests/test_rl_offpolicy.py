"""RL rollouts and their off-policy side, on the tiny model: every group of a step decoded in one session
(the same rollouts as group by group), the sampler/trainer mismatch measured and corrected by TRL's
truncated importance sampling, and updates per generation batch that let the PPO clip act."""

from __future__ import annotations

import math

import pytest
from helpers import LEVELS, capture_trainer, compute_from_params, config_from_params, resolved
from test_rl import PROTOCOL, TEST_RL, _spec

from rcgrpo_tasks.engine.rollout import run_group
from rcgrpo_tasks.env.multi_turn import entries as multi_turn
from rcgrpo_tasks.ops.inputs import read_tsv
from rcgrpo_tasks.train.rl import config as rl_config
from rcgrpo_tasks.train.rl import offpolicy
from rcgrpo_tasks.train.rl import rollout as rl_rollout
from rcgrpo_tasks.train.rl import run as rl_run
from rcgrpo_tasks.train.rl import trainer as rl_trainer


def _rollout(tok, mode: str, **cfg) -> rl_rollout.EngineRollout:
    config = config_from_params(rl_config.RLConfig, "rl", **{**TEST_RL, "categories": ("base",), "max_entries": None, "max_new_tokens": 8,
                                       "num_generations": 3, "batch_size": 9, "micro_batch_size": 3, **cfg})
    entries = {e.id: e for e in multi_turn.load_entries(["base"])[:3]}
    return rl_rollout.EngineRollout(config, PROTOCOL, mode, LEVELS, entries, tok)


@pytest.mark.parametrize("mode", ["rc", "none"])
def test_one_session_gives_the_group_by_group_rollouts(backend, tok, mode):
    """A step's groups decoded together equal one `run_group` per group (fp32: token for token), each group
    keeping its own reward tokens and sampling seed."""
    rollout = _rollout(tok, mode)
    ids, slots = list(rollout.entries), [4, 5, 6]
    together = rollout.groups(backend, ids, step=3, slots=slots, call=0)
    specs = rollout.group_specs(ids, step=3, slots=slots, call=0)
    apart = [run_group(backend, e, len(t), PROTOCOL, sp, t) for e, t, sp in specs]
    assert len({sp.seed for _, _, sp in specs}) == 3  # every group its own seed
    if mode == "rc":
        assert {t for _, tokens, _ in specs for t in tokens} == set(LEVELS)
    for a, b in zip(together, apart):
        assert [t.reward_token for t in a] == [t.reward_token for t in b]
        assert [t.token_ids for t in a] == [t.token_ids for t in b]
        for x, y in zip(a, b):
            assert x.logprobs == pytest.approx(y.logprobs, abs=1e-4)
    assert rollout.generated_tokens == sum(t.n_model_tokens for grp in apart for t in grp) > 0


def test_each_distinct_prompt_prefix_is_prefilled_once(backend):
    """Groups whose tasks share a system prompt: the system prompt is prefilled once, each group's task once
    on top of it, and the rows only add their own tokens; the log-probs are those of a full forward."""
    from test_backends import _check

    from rcgrpo_tasks.engine.backend import SamplingParams

    system, task_a, task_b = list(range(100, 140)), list(range(200, 220)), list(range(300, 317))  # >= PREFIX_MIN
    prompts = [system + task_a + [7], system + task_a + [8], system + task_a + [7],
               system + task_b + [7], system + task_b + [8], [5, 6]]
    sess = backend.session()
    appended = []
    real = sess._append

    def counting(st, ids, new_mask):
        appended.append(int(new_mask.sum()))
        return real(st, ids, new_mask)

    sess._append = counting
    outs = sess.generate(list(range(len(prompts))), prompts, SamplingParams(temperature=1.0, max_new_tokens=4, seed=0))
    _check(backend.model, prompts, outs)
    # Prefilled tokens (decode steps do not append): every distinct prefix once, then each row's own token.
    assert sum(appended) == len(system) + len(task_a) + len(task_b) + len(prompts) + 1  # [5, 6]: its 2 tokens
    assert [len(c) for c in sess.covered[:5]] == [60 + 4] * 3 + [57 + 4] * 2  # prefix, row token, 3 fed


def test_truncated_importance_weights_are_trls(rl_env):
    """The engine path's token weights reach TRL's loss exactly as TRL's vLLM path applies its own
    (`per_token_loss * importance_sampling_ratio`): same loss, same gradient."""
    import torch

    root, model_dir = rl_env
    cfg = config_from_params(rl_config.RLConfig, "rl", **{**TEST_RL, "categories": ("base",)})
    trainer = rl_trainer.build_trainer(resolved(cfg), PROTOCOL, LEVELS, _spec(root, model_dir, "is", "rctp", "rc_grpo"),
                                               track=False)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    dev = trainer.accelerator.device  # the batch lives where TRL's generation step leaves it
    g = torch.Generator().manual_seed(0)
    b, p, c = 2, 5, 6
    mask = torch.tensor([[1, 1, 1, 0, 1, 1], [1, 1, 1, 1, 1, 0]])
    inputs = {"prompt_ids": torch.randint(0, 1000, (b, p), generator=g), "prompt_mask": torch.ones(b, p, dtype=torch.long),
              "completion_ids": torch.randint(0, 1000, (b, c), generator=g),
              "completion_mask": torch.ones(b, c, dtype=torch.long), "tool_mask": mask,
              "advantages": torch.tensor([1.0, -1.0]), "num_items_in_batch": mask.sum()}
    inputs, mask = {k: v.to(dev) for k, v in inputs.items()}, mask.to(dev)
    with torch.no_grad():
        old = trainer._rc_trainer_logps(inputs)
    assert old.device.type == dev.type
    sampler = old + (torch.randn(b, c, generator=g) * 0.8).to(dev)  # an off-policy sampler
    weights = offpolicy.truncated_is_weights(old, sampler, mask, cap=2.0)
    assert float(weights.max()) == 2.0 and float(weights.min()) < 0.5 and bool((weights[mask == 0] == 1).all())
    batch = {**inputs, "old_per_token_logps": old, "ref_per_token_logps": old - 0.1}

    def loss_and_grad(extra: dict, vllm: bool):
        trainer.model.zero_grad()
        trainer.use_vllm, trainer.vllm_importance_sampling_correction = vllm, vllm
        try:
            loss = trainer._compute_loss(trainer.model, {**batch, **extra})
        finally:
            trainer.use_vllm = trainer.vllm_importance_sampling_correction = False
        loss.backward()
        grads = [p.grad.clone() for p in trainer.model.parameters() if p.grad is not None]
        return loss.item(), grads

    mine = loss_and_grad({offpolicy.IS_WEIGHTS: weights}, vllm=False)
    trls = loss_and_grad({"importance_sampling_ratio": weights}, vllm=True)
    plain = loss_and_grad({}, vllm=False)
    assert mine[0] == pytest.approx(trls[0], rel=1e-6) and mine[0] != pytest.approx(plain[0], rel=1e-3)
    assert all(torch.allclose(x, y, atol=1e-7) for x, y in zip(mine[1], trls[1]))


@pytest.mark.parametrize("rollout_dtype,expect_on", [("live", False), ("bfloat16", True)])
def test_mismatch_is_logged_and_corrected_where_the_sampler_differs(rl_env, monkeypatch, rollout_dtype, expect_on):
    """fp32 trainer: sampling from the live fp32 model -> mismatch ~0, weights ~1, correction off (`auto`);
    from a bf16 snapshot -> a measured mismatch, weights != 1, correction on. Per step in the TSV, the summary."""
    root, model_dir = rl_env
    box = capture_trainer(monkeypatch)
    cfg = config_from_params(rl_config.RLConfig, "rl", **{**TEST_RL, "categories": ("base",), "max_steps": 1, "rollout_dtype": rollout_dtype})
    spec = _spec(root, model_dir, f"mismatch-{rollout_dtype}", "rctp", "rc_grpo")
    summary = rl_run.train_rl(cfg, PROTOCOL, LEVELS, spec, track=False, compute=compute_from_params())
    trainer = box["trainer"]
    assert (trainer.rc_importance_cap is not None) == expect_on
    assert (trainer.options.importance_sampling_cap is not None) == expect_on
    assert not trainer.args.vllm_importance_sampling_correction  # TRL corrects its own vLLM rollouts only
    row = read_tsv(spec.plots)[0]
    diff, worst, kl = row["logp_diff_mean"], row["logp_diff_max"], row["sampler_kl"]
    assert summary["mean_logp_diff_mean"] == pytest.approx(diff) and summary["max_logp_diff_max"] == pytest.approx(worst)
    if expect_on:
        assert 1e-4 < diff < worst and kl > 0
        # Tokens reweighted, by no more than the mismatch allows: each weight is exp(d) with |d| <= worst, and
        # some d < 0 (which tokens, and by how much, depends on the host's bf16 kernels).
        assert math.exp(-worst) * (1 - 1e-6) <= row["is_weight_min"] < 1.0
        assert math.exp(-worst) * (1 - 1e-6) <= row["is_weight_mean"] <= math.exp(worst) * (1 + 1e-6)
    else:
        assert diff < 1e-4 and worst < 1e-3 and kl < 1e-6
        assert row["is_weight_mean"] == pytest.approx(1.0) and row["is_capped"] == 0.0
    print(f"\nrollout_dtype={rollout_dtype}: logp_diff_mean={diff:.3g} max={worst:.3g} sampler_kl={kl:.3g} "
          f"is_weight_mean={row['is_weight_mean']:.4g} min={row['is_weight_min']:.4g} capped={row['is_capped']:.3g}")


def _scripted(monkeypatch) -> list:
    """The real engine and scorer; the paper reward replaced by a rule with spread in every group."""
    from rcgrpo_tasks.engine import rollout as engine

    real, calls = engine.run_seeded_groups, []

    def run_seeded_groups(backend, groups, protocol_cfg, provenance=None):
        out = real(backend, groups, protocol_cfg, provenance)
        for trajs in out:
            for i, t in enumerate(trajs):
                t.score = {**t.score, "paper_reward": float(i % 2 == 0)}
        calls.append(out)
        return out

    monkeypatch.setattr(engine, "run_seeded_groups", run_seeded_groups)
    return calls


@pytest.mark.parametrize("updates", [{"num_iterations": 2}, {"minibatches": 2}])
def test_several_updates_per_generation_let_the_clip_act(rl_env, monkeypatch, updates):
    """Two optimizer steps from ONE generation batch (two PPO epochs, or two minibatches): the second trains a
    moved policy on old rollouts, the ratio leaves 1 and TRL's logged clip fraction is above 0."""
    import torch

    root, model_dir = rl_env
    calls = _scripted(monkeypatch)
    box = capture_trainer(monkeypatch)
    cfg = config_from_params(rl_config.RLConfig, "rl", **{**TEST_RL, "categories": ("base",), "learning_rate": 0.05, "epsilon": 0.05,
                                    "rollout_dtype": "live", **updates})
    name = "-".join(f"{k}{v}" for k, v in updates.items())
    spec = _spec(root, model_dir, f"clip-{name}", "rctp", "rc_grpo")
    summary = rl_run.train_rl(cfg, PROTOCOL, LEVELS, spec, track=False, compute=compute_from_params())
    assert len(calls) == 1 and summary["steps"] == 2  # one generation served both steps
    rows = read_tsv(spec.plots)
    assert not math.isnan(rows[0]["reward"]) and math.isnan(rows[1]["reward"])  # step 2 generated nothing
    assert rows[0]["clip_ratio"] == 0.0 and rows[1]["clip_ratio"] > 0.0
    trainer = box["trainer"]
    batch = trainer._buffered_inputs[0]
    new = trainer._rc_trainer_logps(batch)
    mask = offpolicy.loss_mask(batch).bool()
    ratio = torch.exp(new - batch["old_per_token_logps"])[mask]
    assert float((ratio - 1).abs().max()) > cfg.epsilon
    print(f"\n{name}: clip fraction step 2 = {rows[1]['clip_ratio']:.3f}, max |ratio - 1| = "
          f"{float((ratio - 1).abs().max()):.3f}")


def test_minibatches_need_entries_for_the_whole_generation():
    with pytest.raises(ValueError, match="max_entries"):
        config_from_params(rl_config.RLConfig, "rl", **{**TEST_RL, "max_entries": 1, "minibatches": 2})
    with pytest.raises(ValueError, match="minibatches"):
        config_from_params(rl_config.RLConfig, "rl", **{**TEST_RL, "minibatches": 0})
    with pytest.raises(ValueError, match="importance_sampling_cap"):
        config_from_params(rl_config.RLConfig, "rl", **{**TEST_RL, "importance_sampling_cap": 0.5})


def test_auto_rollout_dtype_is_a_snapshot_on_every_cpu_and_the_live_model_on_a_gpu():
    """A CPU samples from a merged copy (the live PEFT model decodes at half its speed), in THE dtype rule's
    dtype (float32 with compute.cpu_bf16 off; bf16 with on, once a run resolves its config); the copy's
    numerics differ from the trainer's, so the correction is on. GPU: live."""
    import torch

    from rcgrpo_tasks.train.rl.rollout_policy import rollout_dtype, sampler_differs

    cfg = config_from_params(rl_config.RLConfig, "rl")

    def resolved_on(device: str, setting: str = "off") -> str:
        return cfg.compute_for(compute_from_params(cpu_bf16=setting), torch.device(device)).decode_dtype

    assert rollout_dtype(resolved_on("cpu")) is torch.float32
    assert sampler_differs(False, rollout_dtype(resolved_on("cpu")), False)
    assert rollout_dtype(resolved_on("cpu", "on")) is torch.bfloat16
    assert resolved_on("cuda") == "live" and rollout_dtype("live") is None
    assert rollout_dtype("float32") is torch.float32
