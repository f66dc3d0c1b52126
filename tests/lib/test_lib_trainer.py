"""`RCGRPOTrainer` against TRL's `GRPOTrainer` on a tiny random model and TRL's own generation: the contract
of docs/library.md, pinned where it can break (private TRL methods are wrapped, not copied)."""

from __future__ import annotations

import copy
import os

import pytest

torch = pytest.importorskip("torch")
trl = pytest.importorskip("trl")

from rcgrpo import RCGRPOConfig, RCGRPOTrainer, reward_token_lora_config  # noqa: E402
from rcgrpo.goal import DEFAULT_LEVELS, format_goal  # noqa: E402
from rcgrpo.group_metrics import generation_metrics, group_advantages  # noqa: E402

LOW, HIGH = DEFAULT_LEVELS
G = 4
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


def dataset(n: int = 8, conversational: bool = True):
    from datasets import Dataset

    def prompt(i):
        text = f"Add {i} and 4."
        return [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": text}] \
            if conversational else text
    return Dataset.from_list([{"prompt": prompt(i), "k": i} for i in range(n)])


def token_reward(completions, reward_token=None, k=None, **_):
    """1 under the high token, 0 under the low one; the row's `k` decides without a token."""
    if reward_token is None:
        return [float(x % 2) for x in k]
    return [1.0 if t == HIGH else 0.0 for t in reward_token]


def length_reward(completions, completion_ids, **_):
    """Depends on the completion only (the same completion earns the same reward on every path)."""
    return [float(len(ids) % 3 == 0) + 0.1 * (ids[0] % 2 if ids else 0) for ids in completion_ids]


def make_args(tmp_path, **kw):
    base = dict(max_steps=1, num_generations=G, per_device_train_batch_size=8, max_completion_length=6,
                report_to=[], use_cpu=True, bf16=False, logging_steps=1, save_strategy="no",
                gradient_checkpointing=False, disable_tqdm=True, seed=3, beta=0.1, learning_rate=1e-2)
    base.update(kw)
    return base


class Recorder:
    """Captures each trainer's scored generation batch and the gradients of its first optimizer step."""

    def __init__(self, trainer):
        self.outputs, self.grads, self.prompts = [], {}, []
        original = trainer._generate_and_score_completions
        rec = self

        def wrapped(inputs):
            out = original(inputs)
            rec.outputs.append({k: v.detach().clone() if hasattr(v, "detach") else v for k, v in out.items()})
            return out

        trainer._generate_and_score_completions = wrapped
        from transformers import TrainerCallback

        class Grads(TrainerCallback):
            def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
                if not rec.grads:
                    rec.grads.update({n: p.grad.detach().clone() for n, p in model.named_parameters()
                                      if p.grad is not None})

        trainer.add_callback(Grads())


def plain_lora():
    """LoRA without trainable token rows: TRL's GRPOTrainer alone trips over PEFT's token wrapper under its fused
    LM head (`rcgrpo.tokens.expose_head_bias`, which RCGRPOTrainer applies)."""
    from peft import LoraConfig

    return LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])


def run(cls, cfg_cls, model, tok, tmp_path, reward=token_reward, ds=None, tokens_trained=True, **kw):
    from transformers import set_seed

    rollout_func = kw.pop("rollout_func", None)
    args = cfg_cls(str(tmp_path / cls.__name__), **make_args(tmp_path, **kw))
    lora = (reward_token_lora_config(model, tok, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
            if tokens_trained else plain_lora())
    set_seed(0)
    trainer = cls(model=model, reward_funcs=reward, args=args, train_dataset=ds or dataset(), processing_class=tok,
                  peft_config=lora, rollout_func=rollout_func)
    rec = Recorder(trainer)
    set_seed(0)
    result = trainer.train()
    return trainer, rec, result


def test_without_conditioning_it_is_grpo(lib_model, tmp_path):
    """conditioning="none": the same generated ids, rewards, advantages, loss and gradients as TRL's GRPOTrainer
    (same seeds, same model, same data)."""
    model, tok = lib_model
    rc, rc_rec, rc_res = run(RCGRPOTrainer, RCGRPOConfig, copy.deepcopy(model), tok, tmp_path, reward=length_reward,
                             conditioning="none", tokens_trained=False)
    kw = {k: v for k, v in make_args(tmp_path).items()}
    from transformers import set_seed

    args = trl.GRPOConfig(str(tmp_path / "grpo"), **kw)
    lora = plain_lora()
    set_seed(0)
    grpo = trl.GRPOTrainer(model=copy.deepcopy(model), reward_funcs=length_reward, args=args, train_dataset=dataset(),
                           processing_class=tok, peft_config=lora)
    g_rec = Recorder(grpo)
    set_seed(0)
    g_res = grpo.train()
    a, b = rc_rec.outputs[0], g_rec.outputs[0]
    for key in ("prompt_ids", "completion_ids", "completion_mask", "advantages"):
        assert torch.equal(a[key], b[key]), key
    assert rc.state.log_history[0]["reward"] == grpo.state.log_history[0]["reward"]
    assert rc_res.training_loss == g_res.training_loss
    assert rc_rec.grads.keys() == g_rec.grads.keys() and any(g.abs().sum() > 0 for g in rc_rec.grads.values())
    assert a["advantages"].abs().sum() > 0  # a batch with signal: the comparison is not between zeros
    for name in rc_rec.grads:
        assert torch.equal(rc_rec.grads[name], g_rec.grads[name]), name


@pytest.mark.parametrize("place", ["first_user", "last_user", "system"])
def test_goal_lands_where_configured_and_only_in_the_prompt(lib_model, tmp_path, place):
    """Each rollout's goal is in its prompt ids at the configured message, never among the completion ids TRL
    trains on; the row's token is the one drawn for it."""
    model, tok = lib_model
    trainer, rec, _ = run(RCGRPOTrainer, RCGRPOConfig, model, tok, tmp_path, reward_goal_place=place)
    out = rec.outputs[0]
    ids = {t: tok.convert_tokens_to_ids(t) for t in DEFAULT_LEVELS}
    assert len(trainer.reward_tokens) == out["prompt_ids"].size(0)
    for row, token in enumerate(trainer.reward_tokens):
        prompt = tok.decode(out["prompt_ids"][row][out["prompt_mask"][row].bool()])
        messages = prompt.split("<|im_end|>")
        where = {"first_user": 1, "last_user": 1, "system": 0}[place]
        assert format_goal(token) in messages[where] and messages[where].count("[Reward Goal:") == 1
        assert prompt.count("[Reward Goal:") == 1
        assert int((out["prompt_ids"][row] == ids[token]).sum()) == 1
        other = ids[LOW if token == HIGH else HIGH]
        assert int((out["prompt_ids"][row] == other).sum()) == 0
        completion = tok.decode(out["completion_ids"][row][out["completion_mask"][row].bool()])
        assert "[Reward Goal:" not in completion  # the loss reads completion ids only: the goal is not there


def test_plain_text_prompts_get_the_goal_at_their_end(lib_model, tmp_path):
    model, tok = lib_model
    trainer, rec, _ = run(RCGRPOTrainer, RCGRPOConfig, model, tok, tmp_path, ds=dataset(conversational=False))
    out = rec.outputs[0]
    for row, token in enumerate(trainer.reward_tokens):
        text = tok.decode(out["prompt_ids"][row][out["prompt_mask"][row].bool()])
        assert text.endswith(format_goal(token)), text


def test_advantages_are_over_the_whole_mixed_token_group(lib_model, tmp_path):
    """The advantage TRL used is GRPO's over each group of G, whatever token each rollout drew, and the logged
    metrics equal a hand count over that batch."""
    model, tok = lib_model
    trainer, rec, _ = run(RCGRPOTrainer, RCGRPOConfig, model, tok, tmp_path)
    gen = trainer.last_generation
    tokens = list(gen.reward_tokens)
    rewards = [1.0 if t == HIGH else 0.0 for t in tokens]
    assert list(gen.rewards) == rewards
    expected = group_advantages(rewards, G)
    assert rec.outputs[0]["advantages"].tolist() == pytest.approx(expected, abs=1e-5)
    mixed = [len(set(tokens[i:i + G])) == 2 for i in range(0, len(tokens), G)]
    flat = sum(not m for m in mixed) / len(mixed)
    logged = trainer.state.log_history[0]
    assert logged["rc/frac_zero_std"] == pytest.approx(flat)
    assert logged["rc/frac_zero_std"] == pytest.approx(logged["frac_reward_zero_std"])
    assert logged["rc/controllability_gap"] == pytest.approx(1.0)
    assert logged["rc/success_high"] == 1.0 and logged["rc/success_low"] == 0.0
    nonzero_high = sum(1 for t, m in zip(tokens, [m for m in mixed for _ in range(G)]) if m and t == HIGH)
    assert logged["rc/nonzero_adv_high"] == nonzero_high
    assert logged["rc/token_frac_high"] == pytest.approx(tokens.count(HIGH) / len(tokens))
    hand = generation_metrics(rewards, tokens, expected, G, levels=DEFAULT_LEVELS, thresholds=[0.5])
    for key, value in hand.items():
        if key in logged:
            assert logged[key] == pytest.approx(value, abs=1e-4), key


def test_fixed_conditions_every_rollout_on_the_highest_level(lib_model, tmp_path):
    model, tok = lib_model
    trainer, _, _ = run(RCGRPOTrainer, RCGRPOConfig, model, tok, tmp_path, conditioning="fixed")
    assert set(trainer.last_generation.reward_tokens) == {HIGH}
    assert trainer.state.log_history[0]["rc/frac_zero_std"] == 1.0  # every group all-high: reward 1 everywhere


def test_a_resumed_step_redraws_the_same_tokens(lib_model, tmp_path):
    """The draw depends on (seed, step, group): two trainers at the same step draw the same tokens."""
    model, tok = lib_model
    a, _, _ = run(RCGRPOTrainer, RCGRPOConfig, copy.deepcopy(model), tok, tmp_path / "a")
    b, _, _ = run(RCGRPOTrainer, RCGRPOConfig, copy.deepcopy(model), tok, tmp_path / "b")
    assert a.last_generation.reward_tokens == b.last_generation.reward_tokens
    assert a.draw_reward_tokens(8) == b.draw_reward_tokens(8)


def test_rollout_func_path_gives_the_rewards_of_trls_generation(lib_model, tmp_path):
    """A rollout function that places the goal itself (`reward_goal_place="external"`, the tokens read from
    `trainer.reward_tokens`) and returns the completions TRL's generation sampled: the same prompt ids, tokens
    and rewards as TRL's own path."""
    model, tok = lib_model
    ref, ref_rec, _ = run(RCGRPOTrainer, RCGRPOConfig, copy.deepcopy(model), tok, tmp_path / "trl",
                          reward=length_reward)
    out = ref_rec.outputs[0]
    completions = [c[m.bool()].tolist() for c, m in zip(out["completion_ids"], out["completion_mask"])]
    from rcgrpo.goal import place_goal

    def replay(prompts, trainer):
        conditioned = [place_goal(p, format_goal(t)) for p, t in zip(prompts, trainer.reward_tokens)]
        ids = [tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
               for p in conditioned]
        return {"prompt_ids": ids, "completion_ids": completions, "logprobs": [[0.0] * len(c) for c in completions]}

    got, got_rec, _ = run(RCGRPOTrainer, RCGRPOConfig, copy.deepcopy(model), tok, tmp_path / "rollout",
                          reward=length_reward, reward_goal_place="external", rollout_func=replay)
    assert got.last_generation.reward_tokens == ref.last_generation.reward_tokens
    assert got.last_generation.rewards == ref.last_generation.rewards
    a, b = got_rec.outputs[0], out
    assert torch.equal(a["prompt_ids"], b["prompt_ids"]) and torch.equal(a["completion_ids"], b["completion_ids"])


def test_evaluation_conditions_on_the_highest_level(lib_model, tmp_path):
    model, tok = lib_model
    trainer, _, _ = run(RCGRPOTrainer, RCGRPOConfig, model, tok, tmp_path)
    metrics = trainer.evaluate(dataset(4))
    assert metrics["eval_rc/token_frac_high"] == 1.0 and metrics["eval_rc/reward_high"] == 1.0


def test_vllm_server_mode_is_refused_under_rc(lib_model, tmp_path):
    model, tok = lib_model
    args = RCGRPOConfig(str(tmp_path), **make_args(tmp_path), use_vllm=True, vllm_mode="server")
    with pytest.raises(NotImplementedError, match="server"):
        RCGRPOTrainer(model=model, reward_funcs=token_reward, args=args, train_dataset=dataset(), processing_class=tok)


def test_a_plain_grpo_config_is_refused(lib_model, tmp_path):
    model, tok = lib_model
    with pytest.raises(TypeError, match="RCGRPOConfig"):
        RCGRPOTrainer(model=model, reward_funcs=token_reward, args=trl.GRPOConfig(str(tmp_path), **make_args(tmp_path)),
                      train_dataset=dataset(), processing_class=tok)


def test_the_model_card_names_rc_grpo(lib_model, tmp_path):
    model, tok = lib_model
    trainer, _, _ = run(RCGRPOTrainer, RCGRPOConfig, model, tok, tmp_path)
    trainer.create_model_card()
    card = (tmp_path / "RCGRPOTrainer" / "README.md").read_text()
    assert "RC-GRPO" in card and "2602.03025" in card


def test_a_model_without_the_reward_tokens_is_refused_unless_unconditioned(lib_tok, build_model, tmp_path):
    model = build_model(len(lib_tok))
    args = RCGRPOConfig(str(tmp_path), **make_args(tmp_path))
    with pytest.raises(ValueError, match="add_reward_tokens"):
        RCGRPOTrainer(model=model, reward_funcs=token_reward, args=args, train_dataset=dataset(),
                      processing_class=lib_tok, peft_config=plain_lora())
    none = RCGRPOConfig(str(tmp_path), **make_args(tmp_path), conditioning="none")
    RCGRPOTrainer(model=model, reward_funcs=token_reward, args=none, train_dataset=dataset(), processing_class=lib_tok,
                  peft_config=plain_lora())


def test_a_reference_without_the_reward_tokens_is_refused(lib_tok, build_model, tmp_path):
    """Full fine-tuning with beta > 0: TRL loads the reference from the model's path; tokens added in memory only
    would leave it without their rows."""
    from rcgrpo import add_reward_tokens

    build_model(len(lib_tok)).save_pretrained(tmp_path / "base")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    add_reward_tokens(model, lib_tok)
    args = RCGRPOConfig(str(tmp_path / "out"), **make_args(tmp_path))
    with pytest.raises(ValueError, match="save the RCTP model"):
        RCGRPOTrainer(model=model, reward_funcs=token_reward, args=args, train_dataset=dataset(), processing_class=lib_tok)


def test_vllm_server_mode_is_allowed_to_a_rollout_function(lib_model, tmp_path):
    """A rollout function gets every row's prompt (the pipeline's engine decodes each row with its token)."""
    model, tok = lib_model
    args = RCGRPOConfig(str(tmp_path), **make_args(tmp_path), use_vllm=True, vllm_mode="server")
    try:
        RCGRPOTrainer(model=model, reward_funcs=token_reward, args=args, train_dataset=dataset(), processing_class=tok,
                      rollout_func=lambda prompts, trainer: {}, peft_config=plain_lora())
    except NotImplementedError as exc:  # the refusal is for TRL's own generation only
        raise AssertionError(exc) from exc
    except Exception:  # no vLLM server here: TRL fails to connect, after the check passed
        pass
