"""The GRPO trainer of the rl stage: TRL's `GRPOTrainer` with the engine's rollout function (docs/rl.md).

- Init and reference: `load_init_model` merges the SFT/RCTP adapter into the base weights and TRL gets a
  fresh LoRA on top, so TRL's reference (adapter disabled) is exactly the init model: the KL term anchors
  to the SFT/RCTP model, as in the paper. Full fine-tuning: the merged init is saved and reloaded so that
  TRL's reference model (built from the model's path) is the init too (`_init_on_disk`). Under LoRA the
  reward tokens' embedding rows (input and output) train too, as in RCTP (PEFT trainable tokens), unless
  the run conditions on no token.
- The trainer is `pipeline_trainer.PipelineTrainer` (the library's `rcgrpo.RCGRPOTrainer` and the pipeline's
  options), configured by `grpo.trainer_args` (the cell's conditioning and options), with `grpo.reward_funcs` and the rollout
  function `rollout.EngineRollout` (the engine decodes the episodes; the trainer draws each rollout's token).
- Divergence: `kl_guard.DivergenceGuardMixin` after the diagnostics callback (`rl.stop_on_divergence`);
  the trainer's `rc_guard` holds its event for `run.train_rl`.
- Diagnostics: every step's row (`diagnostics.PLOT_COLUMNS`) goes to a resumable TSV in the checkpoint
  folder and, as `diag/<column>`, to MLflow (`diagnostics`).
- Placement: `grpo_args` / `build_trainer` take the resolved device (`placement.train_device`) and a fitted
  micro-batch (`placement.fit_micro_batch`); the checkpoint fingerprint keeps the requested one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

from rcgrpo import draw
from rcgrpo.tokens import check_reward_tokens, token_indices
from rcgrpo_tasks.data.onpolicy import sampled_success_rates
from rcgrpo_tasks.engine.models import check_adapter_dir, check_model_dir, load_trained
from rcgrpo_tasks.engine.vllm import reload_in_place, skip_token_adapters
from rcgrpo_tasks.env.entries import read_split, split_entries
from rcgrpo_tasks.env.prompt import ProtocolConfig
from rcgrpo_tasks.ops.config import ConfigError, as_dict
from rcgrpo_tasks.ops.inputs import InputError, read_jsonl
from rcgrpo_tasks.ops.outputs import atomic_dir
from rcgrpo_tasks.train.common import checkpoints, runs
from rcgrpo_tasks.train.common.adapters import lora_targets
from rcgrpo_tasks.train.common.callbacks import lazy_subclass, resumable_callback, step_metrics
from rcgrpo_tasks.train.rl import advantages as adv
from rcgrpo_tasks.train.rl.anchor import check_anchor
from rcgrpo_tasks.train.rl.config import RLConfig, check_deepspeed, check_reward, check_world
from rcgrpo_tasks.train.rl.diagnostics import STEP_MARKER, DiagnosticsMixin, diag_metrics
from rcgrpo_tasks.train.rl.grpo import RolloutLogMixin, reward_funcs, trainer_args
from rcgrpo_tasks.train.rl.kl_guard import DivergenceGuardMixin
from rcgrpo_tasks.train.rl.pipeline_trainer import pipeline_trainer
from rcgrpo_tasks.train.rl.pool import rl_side, train_entries
from rcgrpo_tasks.train.rl.probe import ProbeMixin, probe_ids
from rcgrpo_tasks.train.rl.rollout import EngineRollout

DIAGNOSTICS_FILE = "diagnostics.tsv"
MODEL_META_FILE = "rcgrpo_model.json"


@dataclass(frozen=True)
class RLRun(runs.RunSpec):
    """One grid cell and its paths (CLI arguments, not params: dvc.yaml's foreach over params `grid.rl` varies them)."""

    init: str
    algo: str
    model_dir: Path
    adapter_dir: Path | None
    entries: Path
    split: Path
    out: Path
    checkpoints: Path
    metrics: Path | None = None
    plots: Path | None = None
    conditioning: str | None = None
    pool: Path | None = None
    """The init's own samples of RL's prompts (sample_policy@pool-sft, pool_rctp@<seed>), for `rl.pool_band`."""
    grid_seed: int | None = None
    """The grid seed the run belongs to (params `grid.seeds`; its MLflow tags), None outside a grid."""

    @property
    def mode(self) -> draw.Conditioning:
        mode = self.conditioning or adv.conditioning_for(self.init, self.algo)
        if mode not in draw.CONDITIONING_MODES:
            raise ConfigError(f"conditioning must be one of {draw.CONDITIONING_MODES}, got {mode!r}")
        return mode

    @property
    def name(self) -> str:
        return f"{self.init}-{self.algo}"

    def check(self) -> None:
        """The cell, the model folders and the split, checked before anything heavy is imported or trained."""
        self.mode  # noqa: B018  (raises on a bad cell)
        check_model_dir(self.model_dir)
        if self.adapter_dir is not None:
            check_adapter_dir(self.adapter_dir)
        if not Path(self.entries).is_file():
            raise InputError(f"--entries {self.entries}: not found (run `dvc repro prepare_data`)")
        read_split(self.split)
        if self.pool is not None and not Path(self.pool).is_file():
            raise InputError(f"--pool {self.pool}: not found (run `dvc repro` of the init's pool stage: "
                             f"sample_policy@pool-sft, pool_rctp@<seed>)")


# ---------------------------------------------------------------- models


def load_init_model(model_dir: Path, adapter_dir: Path | None, dtype: str):
    """(model, tokenizer) of the init policy, its adapter MERGED into the weights: the KL reference.

    `load_trained` restores the SFT/RCTP adapter, its tokenizer and the reward-token rows; merging
    makes the init a plain model, so the RL LoRA that TRL adds sits on top of it and "adapter disabled"
    (TRL's reference) is the init model itself.
    """
    import torch

    model, tokenizer = load_trained(model_dir, adapter_dir, dtype=dtype)
    if hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
    return model.to(getattr(torch, dtype)), tokenizer


def check_tokenizer_has_reward_tokens(tokenizer, mode: str, levels: tuple[str, ...]) -> None:
    """`rc`/`fixed` need the lowest and highest reward tokens as single vocabulary items (added by SFT/RCTP): the
    library's check (`rcgrpo.tokens.check_reward_tokens`), before anything trains, as a ConfigError."""
    if mode == "none":
        return
    try:
        check_reward_tokens(tokenizer, adv.reward_levels(levels))
    except ValueError as exc:
        raise ConfigError(f"conditioning {mode!r}: {exc} (the init's tokenizer: train it with `sft` / RCTP, which "
                          "adds them)") from exc


def _init_on_disk(model, tokenizer, spec: RLRun, dtype: str):
    """The merged init saved under the checkpoints folder and reloaded from there, for whatever builds a model
    from the policy's path: TRL's reference under full fine-tuning, TRL's vLLM engine (which would otherwise
    load the base folder, whose vocabulary lacks the reward tokens, and refuse the synced embedding)."""
    import torch
    from transformers import AutoModelForCausalLM

    src = Path(model.config._name_or_path or "")
    if spec.adapter_dir is None or src.resolve() == Path(spec.adapter_dir).resolve():
        return model  # the base, or a full fine-tune folder: its own path is the init already
    init_dir = spec.checkpoints / "init_merged"
    if not (init_dir / "config.json").is_file():
        with atomic_dir(init_dir) as tmp:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
    return AutoModelForCausalLM.from_pretrained(init_dir, dtype=getattr(torch, dtype))


# ---------------------------------------------------------------- build and save


def rl_lora(cfg: RLConfig, model, tokenizer, levels: tuple[str, ...], mode: str, train_tokens: bool = True):
    """The RL LoRA on the merged init; under a reward-token conditioning (`rc`, `fixed`) with the reward
    tokens' embedding rows trainable (PEFT trainable tokens: input and, untied, output rows), as RCTP trains
    them, so RL can move the tokens it conditions on, unless `train_tokens` is off (algo `rc_frozen`: the
    rows stay the init's). The reference (adapter disabled) keeps the init rows."""
    from peft import LoraConfig

    ids = [tokenizer.convert_tokens_to_ids(t) for t in levels] if mode != "none" and train_tokens else []
    return LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=lora_targets(cfg.lora_target_modules), task_type="CAUSAL_LM",
                      trainable_token_indices=token_indices(model, ids) if ids else None)


def build_trainer(cfg: RLConfig, protocol: ProtocolConfig, levels: tuple[str, ...], spec: RLRun,
                  callbacks: list | None = None, track: bool = True, device=None, micro_batch: int | None = None):
    """The trainer (its rollout function `trainer.rollout_func`), everything checked before training. Where it
    resumes is the caller's (`run.train_rl`, from `fingerprint`), as in SFT.

    `protocol`: the episode settings (params `prompt` + `cfg.decode.max_outputs`); `levels`: the reward tokens
    (label_rewards.tokens); `track`: step metrics to the active MLflow run; `device`: where it trains
    (None = CUDA when available); `micro_batch`: train at this micro-batch instead of
    `cfg.micro_batch_size` (more accumulation, the same batch; the checkpoints stay the run's)."""
    from datasets import Dataset

    mode = spec.mode
    if cfg.full_finetune and spec.algo == "rc_frozen":
        raise ConfigError("algo rc_frozen freezes the reward-token rows of the RL LoRA; rl.full_finetune trains "
                          "every weight, those rows included")
    if spec.algo == "rc_anchor":
        try:
            check_anchor(cfg.beta, cfg.beta_low, cfg.loss_type)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
    fit = cfg if micro_batch is None else replace(cfg, micro_batch_size=micro_batch)
    grad_accum = check_world(fit, int(os.environ.get("WORLD_SIZE", "1")))
    check_deepspeed(cfg, mode)
    check_reward(cfg, protocol, split_entries(spec.entries, spec.split, rl_side(spec.split), cfg.categories))
    model, tokenizer = load_init_model(spec.model_dir, spec.adapter_dir, cfg.dtype)
    check_tokenizer_has_reward_tokens(tokenizer, mode, levels)
    success = sampled_success_rates(read_jsonl(spec.pool)) if spec.pool is not None else None
    entries = train_entries(spec.entries, spec.split, cfg, protocol, tokenizer, success)
    rollout = EngineRollout(cfg, protocol, mode, levels, {e.id: e for e in entries}, tokenizer,
                            dynamic=spec.algo == "dynamic", mask_low=spec.algo == "rc_lowmask")
    # No PEFT under full fine-tuning: TRL builds its reference model from `config._name_or_path`, so that
    # path must BE the init.
    lora = None if cfg.full_finetune else rl_lora(cfg, model, tokenizer, levels, mode,
                                                  train_tokens=spec.algo != "rc_frozen")
    model = _init_on_disk(model, tokenizer, spec, cfg.dtype) if cfg.full_finetune or cfg.use_vllm else model
    diagnostics = lazy_subclass(DiagnosticsMixin, "transformers.TrainerCallback")(spec.checkpoints / DIAGNOSTICS_FILE)
    guard = resumable_callback(DivergenceGuardMixin)(
        spec.checkpoints / DIAGNOSTICS_FILE, cfg.guard) if cfg.stop_on_divergence else None
    probe = build_probe(cfg, spec, rollout, entries, mode, levels)
    log = lazy_subclass(RolloutLogMixin, "transformers.TrainerCallback")(spec.checkpoints)
    own = [step_metrics(STEP_MARKER, diag_metrics)] if track else []
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is "experimental" in TRL 1.16
    args, options = trainer_args(fit, mode, levels, spec.checkpoints, grad_accum, spec.algo, device)
    trainer = pipeline_trainer()(
        model=model, reward_funcs=reward_funcs(), args=args, options=options,
        train_dataset=Dataset.from_list([{"prompt": e.id} for e in entries]), processing_class=tokenizer,
        peft_config=lora, rollout_func=rollout,
        callbacks=[log, diagnostics, *([guard] if guard else []), *own, *([probe] if probe else []),
                   *(callbacks or [])],
    )
    trainer.rc_guard = guard
    for callback in (log, probe):
        if callback is not None:
            callback.trainer = trainer
    _finish(trainer, cfg, rollout, lora is not None)
    return trainer


def fingerprint(cfg: RLConfig, protocol: ProtocolConfig, levels: tuple[str, ...], spec: RLRun) -> str:
    """Params + protocol + tokens + the cell + input contents + this training code: checkpoints resume only
    under the same one."""
    import rcgrpo.trainer

    steps = [*Path(rcgrpo.trainer.__file__).parent.glob("*.py"),  # the library, and the pipeline trainer's parts
             *(Path(__file__).with_name(f) for f in ("pipeline_trainer.py", "anchor.py", "kl.py", "logps.py",
                                                      "offpolicy.py")),
             Path(checkpoints.__file__).with_name("generation_state.py")]
    return checkpoints.fingerprint(cfg, protocol=as_dict(protocol), levels=list(levels), init=spec.init,
                                   algo=spec.algo, mode=spec.mode, code=Path(__file__),
                                   step_code={f.name: checkpoints.file_md5(f) for f in sorted(steps)},
                                   entries=Path(spec.entries),
                                   split=Path(spec.split), model=Path(spec.model_dir),
                                   adapter=spec.adapter_dir and Path(spec.adapter_dir))


def build_probe(cfg: RLConfig, spec: RLRun, rollout: EngineRollout, entries: list, mode: str, levels):
    """The run's fixed probe (`probe`), None when `probe_entries` is 0: K entries of the pool and
    `probe_transfer_entries` of RL's side outside it (each drawn by a seed every cell of the grid seed shares),
    conditioned as the cell evaluates (the highest token under `rc`/`fixed`)."""
    if cfg.probe_entries == 0:
        return None
    chosen = probe_ids([e.id for e in entries], cfg.probe_entries, cfg.seed)
    pool = {e.id for e in entries}
    outside = [e for e in split_entries(spec.entries, spec.split, rl_side(spec.split), cfg.categories) if e.id not in pool]
    by_id = {e.id: e for e in [*entries, *outside]}
    chosen += probe_ids([e.id for e in outside], cfg.probe_transfer_entries, cfg.seed + 1)
    token = None if mode == "none" else adv.reward_levels(levels)[1]
    return lazy_subclass(ProbeMixin, "transformers.TrainerCallback")(
        spec.checkpoints, rollout, [by_id[i] for i in chosen], cfg.probe_samples, token, cfg.reward, cfg.max_steps,
        n_pool=min(cfg.probe_entries, len(entries)))


def _finish(trainer, cfg: RLConfig, rollout: EngineRollout, peft: bool) -> None:
    """What the trainer's constructor cannot be told: the engine's end-of-turn ids as EOS ids, TRL's vLLM
    weight sync without PEFT's token deltas (and through vLLM's in-place reload on its CPU build), PEFT's save
    settings."""
    trainer.eos_token_ids = sorted(set(trainer.eos_token_ids) | rollout.end_ids)
    if cfg.use_vllm:
        skip_token_adapters(trainer.vllm_generation)
        if trainer.vllm_generation.mode == "colocate" and trainer.accelerator.device.type == "cpu":
            reload_in_place(trainer.vllm_generation)  # vLLM's CPU build repacks weights TRL's sync writes into
    if peft:
        # The RL LoRA sits on the MERGED init; pointing it at the base folder would make PEFT see the resized
        # vocabulary and store the whole embedding matrix in every checkpoint (~110 MB each, untrained).
        peft_model = trainer.accelerator.unwrap_model(trainer.model)
        peft_model.peft_config["default"].base_model_name_or_path = None
        peft_model.get_base_model().name_or_path = ""  # PEFT refills the field from here on every save
