"""What a TRL GRPO script meets when it swaps in `RCGRPOConfig` / `RCGRPOTrainer`: GRPOConfig's arguments and
defaults, rewards that see the user's prompt (reward functions and reward models), reward tokens that train under
a plain `LoraConfig`, a warning for reward tokens that were never trained, evaluation's own record, a model given
by its path."""

from __future__ import annotations

import itertools
import os
import warnings

import pytest

torch = pytest.importorskip("torch")
trl = pytest.importorskip("trl")

from test_lib_trainer import dataset, make_args, plain_lora, run, token_reward  # noqa: E402

from rcgrpo import RCGRPOConfig, RCGRPOTrainer, add_reward_tokens  # noqa: E402
from rcgrpo.goal import DEFAULT_LEVELS  # noqa: E402

LOW, HIGH = DEFAULT_LEVELS
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
EDITS = {"num_generations": [None, 2, 4, 5, 8], "per_device_train_batch_size": [None, 4, 8, 10],
         "eval_strategy": [None, "steps"], "steps_per_generation": [None, 2], "beta": [None, 0.0]}
"""The edits a GRPO script makes to GRPOConfig, each at TRL's default (None: not passed) or a usual value."""


def _accepts(cls, tmp_path, **kw) -> str | None:
    try:
        cls(str(tmp_path / cls.__name__), report_to=[], use_cpu=True, bf16=False, **kw)
    except ValueError as exc:
        return str(exc).split(":")[0]
    return None


def test_every_grpo_config_rc_grpo_config_accepts_too(tmp_path):
    """Every combination of the usual edits: RCGRPOConfig accepts what GRPOConfig accepts and refuses what it
    refuses, for the same reason; its defaults are GRPOConfig's but the paper's beta."""
    for values in itertools.product(*EDITS.values()):
        kw = {k: v for k, v in zip(EDITS, values) if v is not None}
        if kw.get("eval_strategy"):
            kw["eval_steps"] = 1
        assert _accepts(RCGRPOConfig, tmp_path, **kw) == _accepts(trl.GRPOConfig, tmp_path, **kw), kw
    common = dict(report_to=[], use_cpu=True, bf16=False)
    rc, grpo = RCGRPOConfig(str(tmp_path / "a"), **common), trl.GRPOConfig(str(tmp_path / "b"), **common)
    differ = {k for k, v in grpo.to_dict().items() if rc.to_dict()[k] != v and k not in ("output_dir", "logging_dir")}
    assert differ == {"beta"} and rc.beta == 0.1


class PromptSpy:
    """A reward function that records what it is given."""

    __name__ = "spy"

    def __init__(self):
        self.prompts, self.tokens = [], []

    def __call__(self, prompts, completions, reward_token=None, **_):
        self.prompts += prompts
        self.tokens += reward_token
        return [1.0 if t == HIGH else 0.0 for t in reward_token]


@pytest.mark.parametrize("conversational", [True, False])
def test_reward_functions_see_the_users_prompt_and_the_token_as_a_column(lib_model, tmp_path, conversational):
    model, tok = lib_model
    spy = PromptSpy()
    trainer, rec, _ = run(RCGRPOTrainer, RCGRPOConfig, model, tok, tmp_path, reward=spy,
                          ds=dataset(conversational=conversational))
    users = [row["prompt"] for row in dataset(conversational=conversational)]
    assert spy.prompts and all(p in users for p in spy.prompts)  # the prompt as the dataset holds it
    assert "[Reward Goal:" not in str(spy.prompts)
    assert spy.tokens == trainer.reward_tokens and set(spy.tokens) == {LOW, HIGH}
    prompt = tok.decode(rec.outputs[0]["prompt_ids"][0])  # ... while the policy generated from the goal
    assert "[Reward Goal:" in prompt


def test_a_reward_model_scores_the_users_prompt(lib_model, tmp_path):
    """TRL renders a reward model's input from the prompts it hands it: they carry no goal."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    model, tok = lib_model
    torch.manual_seed(0)
    reward_model = LlamaForSequenceClassification(LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_labels=1, pad_token_id=tok.pad_token_id))
    seen = []
    hook = reward_model.register_forward_pre_hook(lambda m, a, k: seen.append(k["input_ids"]), with_kwargs=True)
    args = RCGRPOConfig(str(tmp_path / "out"), **make_args(tmp_path))
    trainer = RCGRPOTrainer(model=model, reward_funcs=reward_model, reward_processing_classes=tok, args=args,
                            train_dataset=dataset(), processing_class=tok, peft_config=plain_lora())
    trainer.train()
    hook.remove()
    texts = [tok.decode(ids) for batch in seen for ids in batch]
    assert len(texts) == 8 and all("Add" in t for t in texts) and not any("[Reward Goal:" in t for t in texts)


def test_a_plain_lora_config_trains_the_reward_token_rows(lib_model, tmp_path):
    """A user's own LoraConfig (no trainable tokens): the trainer adds the reward tokens' rows, and a step moves
    them, the two apart."""
    model, tok = lib_model
    ids = [tok.convert_tokens_to_ids(t) for t in DEFAULT_LEVELS]
    before = model.get_input_embeddings().weight[ids].detach().clone()
    trainer, _, _ = run(RCGRPOTrainer, RCGRPOConfig, model, tok, tmp_path, tokens_trained=False, learning_rate=0.5)
    peft_model = trainer.accelerator.unwrap_model(trainer.model)
    assert sorted(peft_model.peft_config["default"].trainable_token_indices) == sorted(ids)
    after = peft_model.get_input_embeddings().weight[ids].detach()
    assert not torch.allclose(before, after)


def test_reward_tokens_never_trained_are_warned_about(lib_tok, build_model, tmp_path):
    """Rows added at the embedding's mean are one vector: the model cannot tell the tokens apart (warned);
    rows added apart are not warned about."""
    for init, warned in (("mean_resizing", True), ("apart", False)):
        tok = type(lib_tok).from_pretrained(lib_tok.name_or_path)
        model = build_model(len(tok))
        add_reward_tokens(model, tok, init=init)
        args = RCGRPOConfig(str(tmp_path / init), **make_args(tmp_path))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            RCGRPOTrainer(model=model, reward_funcs=token_reward, args=args, train_dataset=dataset(),
                          processing_class=tok, peft_config=plain_lora())
        said = [str(w.message) for w in caught if "one vector" in str(w.message)]
        assert bool(said) == warned, (init, said)
        assert not said or "RCTP" in said[0]


def test_evaluation_keeps_its_own_record(lib_model, tmp_path):
    model, tok = lib_model
    trainer, _, _ = run(RCGRPOTrainer, RCGRPOConfig, model, tok, tmp_path)
    train = trainer.last_generation
    trainer.evaluate(dataset(4))
    assert trainer.last_generation is train and train.mode == "train"
    assert trainer.last_eval_generation.mode == "eval" and set(trainer.last_eval_generation.reward_tokens) == {HIGH}


def test_a_checkpoint_path_is_swapped_in_as_trl_takes_a_model_id(lib_model, tmp_path):
    """TRL's quick-start shape: the model as a path string, no processing class, a plain LoraConfig."""
    model, tok = lib_model
    model.save_pretrained(tmp_path / "rctp")
    tok.save_pretrained(tmp_path / "rctp")
    args = RCGRPOConfig(str(tmp_path / "out"), **make_args(tmp_path, num_generations=4))
    trainer = RCGRPOTrainer(model=str(tmp_path / "rctp"), reward_funcs=token_reward, args=args,
                            train_dataset=dataset(), peft_config=plain_lora())
    trainer.train()
    assert set(trainer.last_generation.reward_tokens) <= {LOW, HIGH} and trainer.state.global_step == 1
