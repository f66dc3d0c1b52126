"""The GRPO trainer of the rl stage: TRL's `GRPOTrainer` with the engine's rollout function (docs/rl.md).

- Init and reference: `load_init_model` merges the SFT/RCTP adapter into the base weights and TRL gets a
  fresh LoRA on top, so TRL's reference (adapter disabled) is exactly the init model: the KL term anchors
  to the SFT/RCTP model, as in the paper. Full fine-tuning: the merged init is saved and reloaded so that
  TRL's reference model (built from the model's path) is the init too (`_init_on_disk`).
- `RCGRPOTrainer`: TRL does not expose the advantages it used, nor a public way for a rollout function to
  add per-step metrics; the subclass wraps `_generate_and_score_completions` to read the advantages
  (mean |A|, cross-checked against `advantages.group_advantages` in the tests), adds `record_metric`, and
  on CPU projects only completion positions through the LM head. Training, loss, KL and clipping are TRL's.
- Rewards: one TRL reward function per `env.scoring.REWARDS`; one-hot `reward_weights` pick `cfg.reward`.
- Diagnostics: every step's row (PLOT_COLUMNS) goes to a resumable TSV in the checkpoint folder
  (`DiagnosticsMixin`) and, as `diag/<column>`, to MLflow; `summarize` adds the mechanism's averages with
  bootstrap CIs over steps (`train.diagnostics`).
- Placement: `grpo_args` / `build_trainer` take the resolved device (`runs.train_device`) and a fitted
  micro-batch (`runs.fit_micro_batch`); the checkpoint fingerprint keeps the requested one.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

from rcgrpo_tasks.engine.models import check_adapter_dir, check_model_dir, load_trained
from rcgrpo_tasks.env.entries import read_split
from rcgrpo_tasks.env.protocols import ProtocolConfig
from rcgrpo_tasks.env.scoring import REWARDS
from rcgrpo_tasks.ops.config import ConfigError, as_dict
from rcgrpo_tasks.ops.io import InputError, atomic_dir, read_jsonl, write_json
from rcgrpo_tasks.train import advantages as adv
from rcgrpo_tasks.train import processes, runs
from rcgrpo_tasks.train.diagnostics import step_summary
from rcgrpo_tasks.train.grpo import EngineRollout, RLConfig, check_world, train_entries

DIAGNOSTICS_FILE = "diagnostics.tsv"
ROLLOUTS_FILE = "rollouts.jsonl"
"""Every rollout of the run, one JSON line each (`grpo.rollout_record` + its advantage), in the checkpoint
folder: which entries, tokens, rewards and advantages each step trained on, whatever the process count."""
MODEL_META_FILE = "rcgrpo_model.json"
PLOT_COLUMNS = (
    "step", "reward", "reward_high", "reward_low", "reward_none", "controllability_gap", "frac_zero_std",
    "adv_abs_mean", "adv_std", "kl", "clip_ratio", "loss", "reward_paper", "reward_official", "reward_partial",
    "model_tokens", "n_calls", "n_steps", "env_errors", "rollout_tokens_per_s", "rollout_s", "step_time",
    "rollouts_generated", "rollouts_trained", "groups_dropped", "useful_groups", "gen_rounds",
    "gen_tokens_per_useful_group", "frac_zero_std_generated", "step_skipped",
)
PRICE_COLUMNS = ("frac_zero_std_generated", "rollouts_generated", "useful_groups", "gen_tokens_per_useful_group")
"""Per-step columns of what the learning signal cost (summarized with CIs over steps, as the mechanism)."""
_SOURCES = {  # plot column -> key of TRL's averaged step logs
    "reward": "rc/reward", "reward_high": "rc/reward_high", "reward_low": "rc/reward_low",
    "reward_none": "rc/reward_none", "controllability_gap": "rc/controllability_gap",
    "frac_zero_std": "rc/frac_zero_std", "adv_abs_mean": "rc/adv_abs_mean", "adv_std": "rc/adv_std", "kl": "kl",
    "clip_ratio": "clip_ratio/region_mean", "loss": "loss", "reward_paper": "rewards/paper_reward/mean",
    "reward_official": "rewards/official_verdict/mean", "reward_partial": "rewards/partial_credit/mean",
    "model_tokens": "rc/model_tokens", "n_calls": "rc/n_calls", "n_steps": "rc/n_steps",
    "env_errors": "rc/env_errors", "rollout_tokens_per_s": "rc/rollout_tokens_per_s",
    "rollout_s": "rc/rollout_s", "step_time": "step_time",
    **{c: f"rc/{c}" for c in ("rollouts_generated", "rollouts_trained", "groups_dropped", "useful_groups",
                              "gen_rounds", "gen_tokens_per_useful_group", "frac_zero_std_generated",
                              "step_skipped")},
}


@dataclass(frozen=True)
class RLRun(runs.RunSpec):
    """One grid cell and its paths (CLI arguments, not params: the DVC matrix varies them)."""

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

    @property
    def mode(self) -> adv.Conditioning:
        mode = self.conditioning or adv.conditioning_for(self.init, self.algo)
        if mode not in adv.CONDITIONING_MODES:
            raise ConfigError(f"conditioning must be one of {adv.CONDITIONING_MODES}, got {mode!r}")
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


def check_reward_tokens(tokenizer, mode: str, levels: tuple[str, ...]) -> None:
    """`rc`/`fixed` need the lowest and highest reward tokens as single vocabulary items (added by SFT/RCTP)."""
    if mode == "none":
        return
    for tok in adv.reward_levels(levels):
        ids = tokenizer.convert_tokens_to_ids(tok)
        single = len(tokenizer(tok, add_special_tokens=False)["input_ids"]) == 1
        if ids is None or ids == tokenizer.unk_token_id or not single:
            raise ConfigError(f"conditioning {mode!r} needs {tok} as a special token of the init model's tokenizer "
                              "(train the init with `sft` / RCTP, which adds it)")


def _init_on_disk(model, tokenizer, spec: RLRun, dtype: str):
    """Full fine-tuning: the merged init saved under the checkpoints folder and reloaded from there."""
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


# ---------------------------------------------------------------- trainer


class EpochSeededSamplerMixin:
    """TRL's `RepeatSampler` with each epoch's prompt order seeded by (seed, epoch).

    TRL's draws every epoch's order from one generator seeded once, and a resumed run skips the finished
    epochs without iterating them, so from its first new epoch on it would train on other prompts than the
    uninterrupted run. The Trainer calls `set_epoch` at the start of every epoch (through accelerate's
    sharded loaders too)."""

    def set_epoch(self, epoch: int) -> None:
        if self.shuffle:
            self.generator.manual_seed((self.seed or 0) * 1_000_003 + epoch)


class RCGRPOTrainerMixin:
    """GRPOTrainer + per-step metrics from the rollout function + the advantages it used (read-only), and
    a prompt order that a resumed run reproduces (`EpochSeededSamplerMixin`)."""

    last_advantages: list[float] = []

    def _get_train_sampler(self, dataset=None):
        base = super()._get_train_sampler(dataset)
        return runs.lazy_subclass(EpochSeededSamplerMixin, "trl.trainer.utils.RepeatSampler")(
            base.data_source, base.mini_repeat_count, base.batch_size, base.repeat_count, base.shuffle, base.seed)

    def record_metric(self, name: str, value: float) -> None:
        mode = "train" if self.model.training else "eval"
        self._metrics[mode][name].append(float(value))

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        mask = inputs["completion_mask"] if "tool_mask" not in inputs else inputs["completion_mask"] * inputs["tool_mask"]
        self._rc_any_trained = getattr(self, "_rc_any_trained", False) or bool(mask.any())
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    def training_step(self, model, inputs, num_items_in_batch):
        # A step whose every rollout is masked (dynamic sampling found no group with reward spread) must make
        # no update at all: a zero gradient would still move the weights through Adam's moments, so the
        # gradients are dropped (None: the optimizer skips those weights) after the step's last micro-batch.
        loss = super().training_step(model, inputs, num_items_in_batch)
        # Across processes the decision is shared: a process without a kept group still trains (its zero
        # gradient is averaged in) while any other process has one.
        if self._step % self.current_gradient_accumulation_steps == 0:
            trained = processes.any_process(self._rc_any_trained)
            if not trained:
                model.zero_grad(set_to_none=True)
            self.record_metric("rc/step_skipped", 0.0 if trained else 1.0)
            self._rc_any_trained = False
        return loss

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        # TRL returns this process's share of the advantages; the diagnostics cover the whole batch.
        a = self.accelerator.gather(output["advantages"].detach().float()).cpu().tolist()
        self.last_advantages = a
        self.record_metric("rc/adv_abs_mean", adv.advantage_spread(a))
        self.record_metric("rc/adv_std", adv.advantage_std(a))
        records = getattr(self.rollout_func, "records", None)
        if self.accelerator.is_main_process and records and len(records) == len(a):
            self._log_rollouts([{**r, "advantage": x} for r, x in zip(records, a)])
        return output

    def _log_rollouts(self, rows: list[dict]) -> None:
        """Append the step's rollouts to ROLLOUTS_FILE in the checkpoint folder; the first write of a run
        (or of a resumed run) drops the rows of the steps it redoes."""
        path = Path(self.args.output_dir) / ROLLOUTS_FILE
        step = rows[0]["step"]
        if not getattr(self, "_rc_rollouts_opened", False):
            kept = [r for r in read_jsonl(path) if r["step"] < step] if path.is_file() else []
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in kept))
            self._rc_rollouts_opened = True
        with path.open("a") as fh:
            fh.writelines(json.dumps(r, sort_keys=True) + "\n" for r in rows)

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep,
                                           batch_size=None, compute_entropy=False, compute_aux_loss=False,
                                           **multimodal):
        # CPU fast path. Without Triton, TRL 1.16's fused LM head scores EVERY position (static tile
        # shapes for Neuron), i.e. ~1k prompt positions per ~50 completion tokens through a 49k vocabulary,
        # which dominated the CPU step. Here only the completion positions are projected (`logits_to_keep`),
        # with the same temperature scaling. GPU and multimodal inputs: TRL's path.
        if input_ids.device.type != "cpu" or compute_aux_loss or any(v is not None for v in multimodal.values()):
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss,
                **multimodal)
        with self.accelerator.autocast():
            return completion_logps(model, input_ids, attention_mask, logits_to_keep, self.temperature,
                                    batch_size or input_ids.size(0), compute_entropy)


def completion_logps(model, input_ids, attention_mask, logits_to_keep: int, temperature: float, batch_size: int,
                     compute_entropy: bool):
    """input_ids (B, P+C) -> (log-probs (B, C), entropies (B, C) or None, None) of the last C tokens."""
    import torch

    logps, ents = [], []
    for s in range(0, input_ids.size(0), batch_size):
        ids = input_ids[s : s + batch_size]
        out = model(input_ids=ids, attention_mask=attention_mask[s : s + batch_size], use_cache=False,
                    logits_to_keep=logits_to_keep + 1)
        logits = out.logits[:, :-1, :].float() / temperature  # (b, C, V): position t predicts token t+1
        logp_all = torch.log_softmax(logits, dim=-1)
        logps.append(logp_all.gather(-1, ids[:, -logits_to_keep:].unsqueeze(-1)).squeeze(-1))
        if compute_entropy:
            with torch.no_grad():
                ents.append(-(logp_all.exp() * logp_all).sum(-1))
    return torch.cat(logps), (torch.cat(ents) if compute_entropy else None), None


def _reward_func(name: str):
    def reward(completions, **columns):
        return [None if r is None else float(r) for r in columns[f"r_{name}"]]

    reward.__name__ = reward.__qualname__ = name  # TRL logs `rewards/<name>/mean`
    return reward


def reward_funcs() -> list:
    """One TRL reward function per score (`EngineRollout.to_trl` computed it); `reward_weights` select the
    one that drives the advantage."""
    return [_reward_func(name) for name in REWARDS]


def grpo_args(cfg: RLConfig, ckpt_dir: Path, grad_accum: int, device=None):
    """TRL `GRPOConfig` of a run: checkpoints under `ckpt_dir`, no reporting (MLflow goes through callbacks),
    on `device` (`runs.train_device`; None = CUDA when available)."""
    from trl import GRPOConfig

    weights = [1.0 if name == cfg.reward else 0.0 for name in REWARDS]
    kwargs = dict(
        output_dir=str(ckpt_dir), per_device_train_batch_size=cfg.micro_batch_size,
        gradient_accumulation_steps=grad_accum, num_generations=cfg.num_generations, max_steps=cfg.max_steps,
        learning_rate=cfg.learning_rate, lr_scheduler_type=cfg.lr_scheduler, warmup_steps=0, beta=cfg.beta,
        epsilon=cfg.epsilon, num_iterations=cfg.num_iterations, scale_rewards=cfg.scale_rewards,
        loss_type=cfg.loss_type, reward_weights=weights, temperature=cfg.decode.temperature, top_p=cfg.decode.top_p,
        max_completion_length=cfg.decode.max_new_tokens * cfg.decode.max_outputs, disable_dropout=True,
        gradient_checkpointing=cfg.gradient_checkpointing, logging_steps=1, save_strategy="steps",
        save_steps=cfg.save_steps, save_total_limit=cfg.save_total_limit, report_to=[], seed=cfg.seed,
        data_seed=cfg.seed, remove_unused_columns=False, dataloader_num_workers=0, disable_tqdm=True,
        bf16=runs.resolve_bf16(cfg.bf16, device), use_cpu=runs.use_cpu(device), deepspeed=cfg.deepspeed,
        use_vllm=cfg.use_vllm,
        vllm_mode=cfg.vllm_mode, vllm_gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
    )
    kwargs.update(cfg.extra)
    return GRPOConfig(**kwargs)


# ---------------------------------------------------------------- diagnostics


def diagnostics_row(logs: dict, step: int) -> dict:
    """TRL's averaged step logs -> one row of the plots TSV (PLOT_COLUMNS; NaN where a value is missing)."""
    row: dict = {"step": step}
    for col, key in _SOURCES.items():
        value = logs.get(key)
        row[col] = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else float("nan")
    return row


def diag_metrics(logs: dict, step: int) -> dict:
    """A step's row as MLflow metrics `diag/<column>` (the same names live and when replayed after a resume)."""
    return {f"diag/{k}": v for k, v in diagnostics_row(logs, step).items() if k != "step" and not math.isnan(v)}


def summarize(rows: list[dict]) -> dict:
    """Per-run summary of the step rows: mean over steps (NaN-free) of each diagnostic, the last reward, and
    `mechanism` = {column: {mean, ci_low, ci_high, steps}} (95 % bootstrap CI over steps,
    `diagnostics.step_summary`) for the zero-variance share, the advantage spread, the gap and the reward."""
    out: dict = {"steps": len(rows)}
    for col in PLOT_COLUMNS[1:]:
        vals = [r[col] for r in rows if col in r and not math.isnan(r[col])]
        out[f"mean_{col}"] = sum(vals) / len(vals) if vals else None
    out["last_reward"] = rows[-1]["reward"] if rows and not math.isnan(rows[-1]["reward"]) else None
    for col in ("rollouts_generated", "rollouts_trained", "groups_dropped", "useful_groups", "step_skipped"):
        vals = [r[col] for r in rows if not math.isnan(r.get(col, float("nan")))]
        out[f"total_{col}"] = sum(vals) if vals else None
    gen, useful = out["total_rollouts_generated"], out["total_useful_groups"]
    out["rollouts_per_useful_group"] = gen / useful if gen is not None and useful else None
    out["price"] = step_summary(rows, PRICE_COLUMNS)
    out["mechanism"] = step_summary(rows)
    return out


class DiagnosticsMixin:
    """Every step's row -> `tsv` (rows of later steps, redone after a resume, replace the old ones)."""

    def __init__(self, tsv: Path):
        self.tsv = tsv

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs or "rc/reward" not in logs:
            return
        row = diagnostics_row(logs, state.global_step)
        kept = [r for r in runs.read_tsv(self.tsv) if r["step"] < state.global_step]
        runs.write_tsv(self.tsv, kept + [row], PLOT_COLUMNS)


# ---------------------------------------------------------------- build and save


def build_trainer(cfg: RLConfig, protocol: ProtocolConfig, levels: tuple[str, ...], spec: RLRun,
                  callbacks: list | None = None, track: bool = True, device=None, micro_batch: int | None = None):
    """(trainer, checkpoint to resume or None, rollout function) -- everything checked before training.

    `protocol`: the episode settings (params `prompt` + `cfg.decode.max_outputs`); `levels`: the reward tokens
    (label_rewards.tokens); `track`: step metrics to the active MLflow run; `device`: where it trains
    (None = CUDA when available); `micro_batch`: train at this micro-batch instead of
    `cfg.micro_batch_size` (more accumulation, the same batch; the checkpoints stay the run's)."""
    from datasets import Dataset
    from peft import LoraConfig

    mode = spec.mode
    fit = cfg if micro_batch is None else replace(cfg, micro_batch_size=micro_batch)
    grad_accum = check_world(fit, int(os.environ.get("WORLD_SIZE", "1")))
    model, tokenizer = load_init_model(spec.model_dir, spec.adapter_dir, cfg.dtype)
    check_reward_tokens(tokenizer, mode, levels)
    entries = train_entries(spec.entries, spec.split, cfg, protocol, tokenizer)
    fp = runs.fingerprint(cfg, protocol=as_dict(protocol), levels=list(levels), init=spec.init, algo=spec.algo,
                          mode=mode, code=Path(__file__), entries=Path(spec.entries), split=Path(spec.split),
                          model=Path(spec.model_dir), adapter=spec.adapter_dir and Path(spec.adapter_dir))
    resume = runs.resume_point(spec.checkpoints, fp, run=spec.name)
    rollout = EngineRollout(cfg, protocol, mode, levels, {e.id: e for e in entries}, tokenizer,
                            dynamic=spec.algo == "dynamic")
    lora = None
    if cfg.full_finetune:
        # No PEFT: TRL builds its reference model from `config._name_or_path`, so that path must BE the init.
        model = _init_on_disk(model, tokenizer, spec, cfg.dtype)
    else:
        lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                          target_modules=runs.lora_targets(cfg.lora_target_modules), task_type="CAUSAL_LM")
    diagnostics = runs.lazy_subclass(DiagnosticsMixin, "transformers.TrainerCallback")(spec.checkpoints / DIAGNOSTICS_FILE)
    own = [runs.step_metrics("rc/reward", diag_metrics)] if track else []
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is "experimental" in TRL 1.16
    trainer = runs.lazy_subclass(RCGRPOTrainerMixin, "trl.GRPOTrainer")(
        model=model, reward_funcs=reward_funcs(), args=grpo_args(fit, spec.checkpoints, grad_accum, device),
        train_dataset=Dataset.from_list([{"prompt": e.id} for e in entries]), processing_class=tokenizer,
        peft_config=lora, rollout_func=rollout, callbacks=[diagnostics, *own, *(callbacks or [])],
    )
    if lora is not None:
        # The RL LoRA sits on the MERGED init; pointing it at the base folder would make PEFT see the resized
        # vocabulary and store the whole embedding matrix in every checkpoint (~110 MB each, untrained).
        peft_model = trainer.accelerator.unwrap_model(trainer.model)
        peft_model.peft_config["default"].base_model_name_or_path = None
        peft_model.get_base_model().name_or_path = ""  # PEFT refills the field from here on every save
    return trainer, resume, rollout


def save_policy(trainer, cfg: RLConfig, spec: RLRun, folder: Path | None, provenance: dict) -> None:
    """Write the policy into `folder`, the staged `spec.out` (main process; None on the others): init + RL
    LoRA merged (+ `rl_adapter/`), or the full model, with the tokenizer and `provenance` (MODEL_META_FILE).
    Every process must call it: under DeepSpeed ZeRO-3 `save_model` gathers the sharded weights."""
    final = spec.checkpoints / "final"
    if cfg.full_finetune:
        trainer.save_model(str(final))
    if not trainer.accelerator.is_main_process:
        return
    if cfg.full_finetune:
        for f in final.iterdir():
            shutil.move(str(f), folder / f.name)
    else:
        model = trainer.accelerator.unwrap_model(trainer.model)
        model.save_pretrained(folder / "rl_adapter")
        model.merge_and_unload().save_pretrained(folder)
    trainer.processing_class.save_pretrained(folder)
    write_json(folder / MODEL_META_FILE, provenance)
