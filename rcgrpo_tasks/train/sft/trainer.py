"""The SFT / RCTP trainer's build: TRL's `SFTTrainer` + PEFT LoRA (the sft stage; docs/training.md).

- `build_trainer`: the start (`load_start`: the base, or with `init: sft` the SFT output merged into it) +
  reward tokens as special tokens (embeddings grown; new rows at the mean or apart, `reward_token_init`; an
  SFT start already has them, at the mean) + LoRA whose `trainable_token_indices` train those rows
  (`lora_config`), TRL's `SFTConfig` (`trainer_args`), on the resolved device; the rows pre-tokenized with
  THE assistant-token mask (`rows.tokenize_rows`: SmolLM2's template has no `{% generation %}` markers, so
  TRL gets `input_ids` + `assistant_masks`); the trainer class is `SFTTrainer` + `trainer_mixin.RcgrpoSFTTrainerMixin`
  (tokens/s, the token rows' own learning rate `token_lr_multiplier`, the CPU loss over assistant positions
  only, the pairs' order, small saves).
- `fingerprint`: what a checkpoint resumes under (params, tokens, inputs and this module's code).
CPU speed: float32 (bf16 autocast only on a GPU by default: THE dtype rule, `SftConfig.compute_for`), no gradient
checkpointing (TRL's default turns it on), the LM head on assistant positions only (TRL's fused head scores
every position off-GPU); bench/sft_throughput.py measures it.
"""

from __future__ import annotations

from pathlib import Path

from rcgrpo.tokens import add_reward_tokens, expose_head_bias, token_indices
from rcgrpo_tasks.data.chat import answer_goal_template, goal_place
from rcgrpo_tasks.engine.models import load_trained
from rcgrpo_tasks.ops.config import ConfigError
from rcgrpo_tasks.train.common import checkpoints, placement
from rcgrpo_tasks.train.common.adapters import lora_targets
from rcgrpo_tasks.train.common.callbacks import lazy_subclass
from rcgrpo_tasks.train.sft.config import SftConfig, SftRun
from rcgrpo_tasks.train.sft.objective import rctp_objective
from rcgrpo_tasks.train.sft.rows import tokenize_rows
from rcgrpo_tasks.train.sft.trainer_mixin import RcgrpoSFTTrainerMixin


def lora_config(cfg: SftConfig, model, token_ids: list[int]):
    """LoRA on `lora_target_modules` + the special-token rows as PEFT trainable tokens.

    Tied embeddings (SmolLM2): the input rows, tied into the LM head by PEFT. Untied (Qwen): the rows of
    both the input embedding and the LM head, so the saved adapter restores them exactly on load.
    """
    from peft import LoraConfig

    return LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=lora_targets(cfg.lora_target_modules),
                      trainable_token_indices=token_indices(model, token_ids), task_type="CAUSAL_LM")


def trainer_args(cfg: SftConfig, ckpt_dir: Path, bf16: bool, device=None):
    """TRL `SFTConfig` of a run: checkpoints under `ckpt_dir`, no reporting (MLflow goes through callbacks),
    on `device` (`placement.train_device`; None = CUDA when available)."""
    from trl import SFTConfig

    return SFTConfig(
        output_dir=str(ckpt_dir), learning_rate=cfg.learning_rate, num_train_epochs=cfg.num_epochs,
        max_steps=cfg.max_steps, per_device_train_batch_size=cfg.batch_size,
        gradient_accumulation_steps=cfg.grad_accum, lr_scheduler_type=cfg.lr_scheduler,
        warmup_steps=cfg.warmup_ratio, weight_decay=cfg.weight_decay, max_grad_norm=cfg.max_grad_norm,
        seed=cfg.seed, data_seed=cfg.seed, bf16=bf16, gradient_checkpointing=cfg.gradient_checkpointing,
        max_length=None if cfg.padding_free else cfg.max_length, padding_free=cfg.padding_free,
        logging_steps=cfg.logging_steps, save_strategy="steps", save_steps=cfg.save_steps,
        save_total_limit=cfg.save_total_limit, report_to=[], use_cpu=placement.use_cpu(device),
        deepspeed=cfg.deepspeed, disable_tqdm=True, dataloader_num_workers=0,
    )


def load_start(cfg: SftConfig, model_dir: Path, init_adapter: Path | None):
    """(model, tokenizer) a run starts from: the base folder, or (`init: sft`) the SFT output merged into it
    (`engine.models.load_trained`, then PEFT's merge), in `cfg.model_dtype`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if init_adapter is None:
        return (AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, cfg.model_dtype)),
                AutoTokenizer.from_pretrained(model_dir))
    model, tokenizer = load_trained(model_dir, init_adapter, dtype="float32")  # merged in float32, as RL does
    if hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
    return model.to(getattr(torch, cfg.model_dtype)), tokenizer


def build_trainer(cfg: SftConfig, model_dir: Path, rows: list[dict], tokens: tuple[str, ...], ckpt_dir: Path,
                  callbacks: list | None = None, device=None, init_adapter: Path | None = None):
    """The trainer: base (or merged SFT: `init_adapter`) + added tokens (`trainer.token_ids`) + LoRA, its rows
    tokenized (`trainer.data_stats`), ready to train on `device` (None = CUDA when available); the tokenizer
    is `trainer.processing_class`. Where it resumes is the caller's (`run.train_variant`), as in RL. The reward tokens are `tokens`
    minus `cfg.extra_special_tokens`, lowest first (`reward_token_init: apart` spreads them in that order)."""
    from datasets import Dataset

    # first: under ZeRO-3 the model loads sharded
    args = trainer_args(cfg, ckpt_dir, placement.resolved_bf16(cfg.bf16), device)
    model, tokenizer = load_start(cfg, model_dir, init_adapter)
    levels = tuple(t for t in tokens if t not in cfg.extra_special_tokens)
    token_ids = add_reward_tokens(model, tokenizer, tokens, init=cfg.reward_token_init, seed=cfg.seed, levels=levels)
    if goal_place(tokenizer) != cfg.reward_goal_place:
        if cfg.reward_goal_place == "user":
            raise ConfigError(f"sft.reward_goal_place: user, but the start model {model_dir} renders the reward "
                              "goal before the answer (its chat template); start from a model without it")
        tokenizer.chat_template = answer_goal_template(tokenizer.chat_template)
    train_rows, stats = tokenize_rows(rows, tokenizer, cfg.max_length, cfg.max_examples, cfg.loss_on)
    peft_config = None if cfg.full_finetune else lora_config(cfg, model, token_ids)
    trainer = lazy_subclass(RcgrpoSFTTrainerMixin, "trl.SFTTrainer")(
        model=model, args=args, processing_class=tokenizer,
        train_dataset=Dataset.from_list(train_rows), peft_config=peft_config, callbacks=callbacks or [])
    expose_head_bias(trainer.model)
    trainer.compact_lm_head = cfg.compact_lm_head
    trainer.shared_prefix = cfg.shared_prefix_min_tokens
    trainer.keep_order = cfg.row_order in ("pairs", "stratified")
    ids_of = dict(zip(tokens, token_ids))
    if len(levels) >= 2:
        trainer.objective = rctp_objective(ids_of[levels[-1]], ids_of[levels[0]], cfg.first_token_weight,
                                           cfg.unlikelihood, trainer._metrics["train"])
    trainer.token_lr = (cfg.token_lr_multiplier, list(token_ids))
    trainer.token_ids, trainer.data_stats = tuple(token_ids), stats
    return trainer


def fingerprint(cfg: SftConfig, tokens: tuple[str, ...], spec: SftRun) -> str:
    """Params + tokens + input contents + this training code: checkpoints resume only under the same one."""
    return checkpoints.fingerprint(cfg, tokens=tokens, variant=spec.variant, code=Path(__file__),
                            data=Path(spec.data), model=Path(spec.model_dir),
                            init=spec.init_adapter and Path(spec.init_adapter))
