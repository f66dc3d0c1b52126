"""The SFT / RCTP-FT settings and one run's paths (the sft stage; docs/training.md).

- `SftConfig` (params.yaml `sft`, per-variant overrides via `resolve`: params `sft.variants` holds the two
  runs of one definition); `SftRun` (one run's paths and their checks).
The rows it trains on are `train.sft.rows`', the trainer (`build_trainer`) is `train.sft.trainer`'s, one run
end to end (`train_variant`, the outputs and the summary) `train.sft.run`'s. Departure from the paper: LoRA
(+ trainable reward-token rows) instead of full fine-tuning by default.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from rcgrpo.tokens import REWARD_TOKEN_INITS
from rcgrpo_tasks.data.chat import TEMPLATE_GOAL_PLACES
from rcgrpo_tasks.engine.compute import ComputeConfig, ResolvedCompute, resolve_compute
from rcgrpo_tasks.ops.config import ConfigError, as_dict, from_dict
from rcgrpo_tasks.ops.inputs import InputError
from rcgrpo_tasks.train.common import runs
from rcgrpo_tasks.train.sft.rows import LOSS_ON, ORDERS


@dataclass(frozen=True, kw_only=True)
class SftConfig:
    learning_rate: float
    """Peak learning rate (AdamW). The paper: 1e-5 with full fine-tuning of a 7B model."""
    num_epochs: float
    """Passes over the dataset (the paper: 2 for SFT, 5 for RCTP); `max_steps` > 0 caps it."""
    max_steps: int
    """Optimizer steps; > 0 overrides `num_epochs` (the embedded CPU budget)."""
    batch_size: int
    """Sequences per device per micro-batch."""
    grad_accum: int
    """Micro-batches per optimizer step (effective batch = batch_size x grad_accum x devices)."""
    max_length: int
    """Tokens per sequence; longer chats are cut at the end, rows left without assistant tokens dropped."""
    max_examples: int | None
    """Train on this many rows (seeded, round-robin over reward tokens, skipping rows that do not fit
    `max_length`); None = all."""
    warmup_ratio: float
    """Fraction of steps of linear warm-up."""
    lr_scheduler: Literal["linear", "cosine", "constant", "constant_with_warmup"]
    """Learning-rate schedule after warm-up."""
    weight_decay: float
    """AdamW weight decay."""
    max_grad_norm: float
    """Gradient clipping norm."""
    seed: int
    """Seed of the data order, LoRA init and dropout."""
    full_finetune: bool
    """Train every weight (GPU, accelerate/DeepSpeed) instead of LoRA; output is a full model folder."""
    lora_r: int
    """LoRA rank."""
    lora_alpha: int
    """LoRA scaling numerator (scale = alpha / r)."""
    lora_dropout: float
    """Dropout on the LoRA input."""
    lora_target_modules: tuple[str, ...]
    """Module names that get LoRA (or ("all-linear",))."""
    extra_special_tokens: tuple[str, ...]
    """Special tokens added besides the reward tokens of `label_rewards.tokens`."""
    reward_token_init: Literal["mean_resizing", "apart", "words"]
    """Rows of the added tokens: `mean_resizing` = at the old rows' mean (transformers; the reward tokens
    start as one vector), `apart` = spread apart at a real token's distance from the mean
    (`rcgrpo.tokens.apart_rows`, seeded by `seed`)."""
    token_lr_multiplier: float
    """Learning rate of the added tokens' rows = this x `learning_rate` (LoRA: their own optimizer group;
    full fine-tuning: their steps scaled, `adapters.scale_row_updates`). 1.0 = one lr for everything."""
    init: Literal["base", "sft"]
    """What the run fine-tunes: `base` = the base model (`--model-dir`); `sft` = the SFT model, its adapter
    (`--init-adapter`) merged into the base weights, then a fresh LoRA and the reward-token rows on it; the
    output is then the merged model folder. RCTP from SFT mirrors the paper, whose RCTP starts from an
    instruct model that already calls tools: the first steps are not spent teaching the call format. With
    `full_finetune` every weight of the SFT model trains and the output is a full folder as usual."""
    row_order: Literal["balanced", "pairs", "stratified"]
    """`balanced`: rows interleaved over tokens and reshuffled by the data sampler; `pairs`: each prompt's
    rows side by side, pairs shuffled, that order kept (`rows.pair_order`: a pair's two rows share a
    micro-batch when `batch_size` is even, else follow each other); `stratified`: the pairs alternate between
    those whose failure is the base model's (prose) and the others, the smaller kind cycled
    (`rows.stratified_order`: with micro-batch 2 and accumulation 2 every optimizer step holds one of each).
    One process: under DDP each rank would need its own slice of the pairs."""
    first_token_weight: float
    """The first answer token of both rows of a pair whose answers part there counts this many times in the NLL
    (`objective`): the token where a reward token can part a success from a format-divergent failure.
    1 = TRL's token-mean loss."""
    unlikelihood: float
    """Weight of -log(1 - p(the other row's opening)) for both rows of a pair whose answers part at the first
    token (`objective`), in units of one answer token's NLL. 0 = off."""
    loss_on: Literal["completion", "divergent"]
    """`completion`: every assistant token; `divergent`: of each pair (same prompt, both tokens) only the
    tokens from where its two answers part (`rows.divergent_masks`): the shared ones teach "the same
    output under either token" and carry no information about it. Rows without a partner keep every token."""
    reward_goal_place: Literal["user", "answer"]
    """Where the model reads its reward goal: `user` = the text `[Reward Goal: <token>]` ends the first user
    message (the paper); `answer` = its token opens the first answer (`data.chat.answer_goal_template`: the
    saved chat template renders it there, so RL, evaluation and controllability prompt the model the same
    way; the data keep the paper's form). Acts on rows with a goal only."""
    margin_every: int
    """> 0: log the teacher-forced margin (`margin`) every this many optimizer steps (and before the
    first) on `margin_entries` dev entries (`--entries`, `--split`; never the held-out side: the step count is
    chosen on this curve): when the token starts to be read.
    One process only (skipped under DDP / DeepSpeed)."""
    margin_entries: int
    """Dev entries of the margin curve (round-robin over categories)."""
    require_reward_token: bool
    """Every row must carry a reward token (RCTP) — guards against training RCTP on the SFT file."""
    bf16: bool | None
    """bf16 autocast; None = THE dtype rule (`compute_for`: on a GPU with bf16, on a CPU as params
    `compute.cpu_bf16` says)."""
    model_dtype: Literal["float32", "bfloat16"]
    """Dtype the base weights are loaded in (bf16 halves memory; LoRA weights stay float32)."""
    gradient_checkpointing: bool
    """Recompute activations in backward: less memory, slower; only when memory demands it."""
    padding_free: bool
    """Flatten each batch into one sequence (no padding; block-diagonal attention)."""
    compact_lm_head: bool
    """On CPU, project only assistant positions through the LM head (TRL scores all of them there)."""
    shared_prefix_min_tokens: int | None
    """With `compact_lm_head`: a micro-batch's shared tokens (an RCTP pair's prompt, up to the goal's token)
    through the trunk once where that saves at least this many tokens a row (`engine.shared_prefix`; the same
    loss as the padded forward up to float rounding); null = always the padded forward."""
    save_steps: int
    """Checkpoint every this many optimizer steps (resume point)."""
    save_total_limit: int
    """Checkpoints kept (2: a checkpoint being written when killed never leaves zero complete ones)."""
    keep_checkpoints: bool
    """Keep the checkpoints after a successful run (default: delete them, the adapter is the output)."""
    logging_steps: int
    """Log loss / lr / grad norm / tokens/s every this many steps."""
    deepspeed: str | None = None
    """DeepSpeed JSON config (e.g. configs/ds_zero3.json) when launched with `accelerate launch`/torchrun."""
    log_model: bool
    """Log the final adapter to MLflow with `mlflow.transformers` (base = the local model folder)."""
    variants: dict = field(default_factory=dict)
    """Per-variant overrides, {run: {key: value}} (dvc.yaml foreach: `sft` = experts only, the paper's SFT
    baseline; `rctp` = mixed data with reward goals, RCTP-FT from the SFT model); `resolve` applies one.
    Empty: no variant (structural; the runs' values are params `sft.variants`)."""

    def __post_init__(self) -> None:
        checks = [
            (self.learning_rate > 0 and math.isfinite(self.learning_rate), f"learning_rate must be > 0, got {self.learning_rate}"),
            (self.num_epochs > 0 or self.max_steps > 0, "num_epochs must be > 0 (or set max_steps > 0)"),
            (self.max_steps == -1 or self.max_steps > 0, f"max_steps must be -1 or > 0, got {self.max_steps}"),
            (self.batch_size >= 1 and self.grad_accum >= 1, "batch_size and grad_accum must be >= 1"),
            (self.max_length >= 16, f"max_length must be >= 16, got {self.max_length}"),
            (self.max_examples is None or self.max_examples >= 1, "max_examples must be >= 1 or null"),
            (0 <= self.warmup_ratio < 1, f"warmup_ratio must be in [0, 1), got {self.warmup_ratio}"),
            (self.weight_decay >= 0 and self.max_grad_norm > 0, "weight_decay >= 0 and max_grad_norm > 0 required"),
            (self.lora_r >= 1, f"lora_r (LoRA rank) must be >= 1, got {self.lora_r}"),
            (self.lora_alpha > 0, f"lora_alpha must be > 0, got {self.lora_alpha}"),
            (0 <= self.lora_dropout < 1, f"lora_dropout must be in [0, 1), got {self.lora_dropout}"),
            (bool(self.lora_target_modules), "lora_target_modules must not be empty"),
            (self.save_steps >= 1 and self.save_total_limit >= 1 and self.logging_steps >= 1,
             "save_steps, save_total_limit and logging_steps must be >= 1"),
            (all(isinstance(v, dict) for v in self.variants.values()), "variants: each value must be a mapping"),
            (self.reward_token_init in REWARD_TOKEN_INITS, f"reward_token_init must be one of {REWARD_TOKEN_INITS}"),
            (self.token_lr_multiplier > 0 and math.isfinite(self.token_lr_multiplier),
             f"token_lr_multiplier must be > 0, got {self.token_lr_multiplier}"),
            (self.init in ("base", "sft"), f"init must be base or sft, got {self.init!r}"),
            (self.shared_prefix_min_tokens is None or self.shared_prefix_min_tokens >= 0,
             f"shared_prefix_min_tokens must be >= 0 or null, got {self.shared_prefix_min_tokens}"),
            (self.row_order in ORDERS, f"row_order must be one of {ORDERS}, got {self.row_order!r}"),
            (self.first_token_weight > 0 and math.isfinite(self.first_token_weight),
             f"first_token_weight must be > 0, got {self.first_token_weight}"),
            (self.unlikelihood >= 0 and math.isfinite(self.unlikelihood),
             f"unlikelihood must be >= 0, got {self.unlikelihood}"),
            (self.loss_on in LOSS_ON, f"loss_on must be one of {LOSS_ON}, got {self.loss_on!r}"),
            (self.reward_goal_place in TEMPLATE_GOAL_PLACES,
             f"reward_goal_place must be one of {TEMPLATE_GOAL_PLACES}, got {self.reward_goal_place!r}"),
            (self.margin_every >= 0 and self.margin_entries >= 1, "margin_every must be >= 0, margin_entries >= 1"),
            (self.token_lr_multiplier == 1.0 or not (self.full_finetune and self.deepspeed),
             "token_lr_multiplier != 1 with full_finetune needs whole embedding rows: not under DeepSpeed"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        self._check_token_init()

    def _check_token_init(self) -> None:
        """A variant that starts from the SFT model (`init: sft`) finds the reward tokens already there, their
        rows made by the `sft` variant's `reward_token_init` (`add_reward_tokens` only initialises tokens it
        adds): its own, different, value would silently do nothing, so it is refused here."""
        shared = {k: v for k, v in as_dict(self).items() if k != "variants"}
        made_by = {**shared, **self.variants.get("sft", {})}["reward_token_init"]
        for name, over in self.variants.items():
            own = {**shared, **over}
            if own["init"] == "sft" and own["reward_token_init"] != made_by:
                raise ValueError(f"variants.{name}: reward_token_init {own['reward_token_init']!r} does nothing with "
                                 f"init sft (the tokens come with the SFT model, their rows made by variant sft's "
                                 f"{made_by!r}): set it on the sft variant or leave it out")

    def compute_for(self, compute: ComputeConfig, device=None, model_dir: Path | None = None) -> ResolvedCompute:
        """THE dtype rule for a run of this config, once (`engine.compute.resolve_compute`): its training
        autocast (`bf16: null`: on a GPU with bf16, on a CPU as `compute.cpu_bf16` says), on `device`."""
        return resolve_compute(compute, train=self.bf16, trains=True, model_dir=model_dir, device=device)

    def resolved(self, compute: ResolvedCompute) -> SftConfig:
        """This config with `compute`'s choice made concrete (the trainer refuses a null `bf16`)."""
        return replace(self, bf16=compute.train_bf16)

    def resolve(self, variant: str) -> SftConfig:
        """This config with `variants[variant]` applied (validated like the base section)."""
        if variant not in self.variants:
            raise ConfigError(f"sft: unknown variant {variant!r}; configured: {sorted(self.variants)}")
        merged = {**as_dict(self), **self.variants[variant], "variants": {}}
        return from_dict(SftConfig, merged, where=f"sft.variants.{variant}")


@dataclass(frozen=True)
class SftRun(runs.RunSpec):
    """One sft run: the variant and its paths (CLI arguments; `dvc.yaml` foreach varies them)."""

    variant: str
    model_dir: Path
    data: Path
    out: Path
    checkpoints: Path
    metrics: Path | None = None
    plots: Path | None = None
    init_adapter: Path | None = None
    entries: Path | None = None
    split: Path | None = None
    grid_seed: int | None = None
    """The grid seed of an RCTP run (params `grid.seeds`; its MLflow tags), None outside a grid."""

    def check(self) -> None:
        """Inputs exist — checked before anything heavy is imported or trained."""
        if not (Path(self.model_dir) / "config.json").is_file():
            raise InputError(f"--model-dir {self.model_dir}: no config.json (run `dvc repro prepare_model`)")
        if not Path(self.data).is_file():
            raise InputError(f"--data {self.data}: dataset not found (run `dvc repro label_rewards`)")
        if self.init_adapter is not None and not Path(self.init_adapter).is_dir():
            raise InputError(f"--init-adapter {self.init_adapter}: not found (run `dvc repro sft@sft`)")
        for flag, path in (("--entries", self.entries), ("--split", self.split)):
            if path is not None and not Path(path).is_file():
                raise InputError(f"{flag} {path}: not found (run `dvc repro prepare_data`)")

    def merged(self, cfg: SftConfig) -> bool:
        """The output is the LoRA merged into a model folder (LoRA on the merged SFT model)."""
        return self.init_adapter is not None and not cfg.full_finetune

    def reading(self, cfg: SftConfig) -> SftRun:
        """This run as `cfg` reads it: under `init: base` without the `--init-adapter` dvc.yaml hands every RCTP
        run (the SFT output: a dep either way), so a profile that trains RCTP from the base model (the paper's)
        runs the same stage command."""
        return replace(self, init_adapter=None) if cfg.init == "base" else self

    def check_against(self, cfg: SftConfig) -> None:
        """The paths the config needs: `init: sft` an `--init-adapter`, a margin curve `--entries` and `--split`."""
        if cfg.init == "sft" and self.init_adapter is None:
            raise ConfigError(f"sft.variants.{self.variant}: init sft needs --init-adapter (the sft@sft output)")
        if cfg.init == "base" and self.init_adapter is not None:
            raise ConfigError(f"sft.variants.{self.variant}: --init-adapter given but init is base")
        if cfg.margin_every and (self.entries is None or self.split is None):
            raise ConfigError(f"sft.variants.{self.variant}: margin_every needs --entries and --split")
