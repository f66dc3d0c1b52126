"""The GRPO trainer of the rl stage: TRL's `GRPOTrainer` with the engine's rollout function (docs/rl.md).

- Init and reference: `load_init_model` merges the SFT/RCTP adapter into the base weights and TRL gets a
  fresh LoRA on top, so TRL's reference (adapter disabled) is exactly the init model: the KL term anchors
  to the SFT/RCTP model, as in the paper. Full fine-tuning: the merged init is saved and reloaded so that
  TRL's reference model (built from the model's path) is the init too (`_init_on_disk`). Under LoRA the
  reward tokens' embedding rows (input and output) train too, as in RCTP (PEFT trainable tokens), unless
  the run conditions on no token.
- `RCGRPOTrainer`: TRL does not expose the advantages it used, nor a public way for a rollout function to
  add per-step metrics; the subclass wraps `_generate_and_score_completions` to read the advantages
  (mean |A|, cross-checked against `advantages.group_advantages` in the tests), measures and corrects the
  sampler/trainer mismatch (`offpolicy`), adds `record_metric`, skips a step with nothing to train on
  before its backward (so no optimizer, DeepSpeed's included, moves a weight), and on CPU projects only
  completion positions through the LM head. Training, loss, KL and clipping are TRL's.
- Updates per generation batch: `num_iterations` (PPO epochs) and `minibatches` (TRL's
  `steps_per_generation` = minibatches x gradient accumulation).
- Rewards: one TRL reward function per `env.scoring.REWARDS`; one-hot `reward_weights` pick `cfg.reward`.
  The engine's end-of-turn ids are TRL's EOS ids too (`completions/clipped_ratio` counts budget cuts).
- Diagnostics: every step's row (`diagnostics.PLOT_COLUMNS`) goes to a resumable TSV in the checkpoint
  folder and, as `diag/<column>`, to MLflow (`train.diagnostics`).
- Placement: `grpo_args` / `build_trainer` take the resolved device (`runs.train_device`) and a fitted
  micro-batch (`runs.fit_micro_batch`); the checkpoint fingerprint keeps the requested one.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path

from rcgrpo_tasks.data.onpolicy import sampled_success_rates
from rcgrpo_tasks.engine.models import check_adapter_dir, check_model_dir, last_positions, load_trained
from rcgrpo_tasks.engine.vllm import reload_in_place, skip_token_adapters
from rcgrpo_tasks.env.entries import read_split, split_entries
from rcgrpo_tasks.env.protocols import ProtocolConfig
from rcgrpo_tasks.env.scoring import REWARDS
from rcgrpo_tasks.ops.config import ConfigError, as_dict
from rcgrpo_tasks.ops.inputs import InputError, read_jsonl
from rcgrpo_tasks.ops.outputs import atomic_dir, write_json
from rcgrpo_tasks.train import advantages as adv
from rcgrpo_tasks.train import processes, runs
from rcgrpo_tasks.train.adapters import expose_head_bias, token_indices
from rcgrpo_tasks.train.diagnostics import STEP_MARKER, DiagnosticsMixin, diag_metrics
from rcgrpo_tasks.train.grpo import EngineRollout, RLConfig, check_deepspeed, check_reward, check_world, train_entries
from rcgrpo_tasks.train.offpolicy import OffPolicyMixin, loss_mask
from rcgrpo_tasks.train.rollout_policy import rollout_dtype, sampler_differs

DIAGNOSTICS_FILE = "diagnostics.tsv"
ROLLOUTS_FILE = "rollouts.jsonl"
"""Every rollout of the run, one JSON line each (`grpo.rollout_record` + its advantage), in the checkpoint
folder: which entries, tokens, rewards and advantages each step trained on, whatever the process count."""
MODEL_META_FILE = "rcgrpo_model.json"


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
    policy: Path | None = None
    """The SFT model's own samples (sample_policy), for `rl.min_sampled_success`."""

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
        if self.policy is not None and not Path(self.policy).is_file():
            raise InputError(f"--policy {self.policy}: not found (run `dvc repro sample_policy`)")


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


class PreparedInputs:
    """A micro-batch `RCGRPOTrainerMixin.training_step` already took from TRL's buffer (`_prepare_inputs`
    hands it through unchanged)."""

    def __init__(self, inputs: dict):
        self.inputs = inputs


class RCGRPOTrainerMixin(OffPolicyMixin):
    """GRPOTrainer + per-step metrics from the rollout function + the advantages it used (read-only), the
    sampler/trainer mismatch and its correction (`OffPolicyMixin`), steps with nothing to train on skipped,
    and a prompt order that a resumed run reproduces (`EpochSeededSamplerMixin`)."""

    last_advantages: list[float] = []

    def _get_train_sampler(self, dataset=None):
        base = super()._get_train_sampler(dataset)
        return runs.lazy_subclass(EpochSeededSamplerMixin, "trl.trainer.utils.RepeatSampler")(
            base.data_source, base.mini_repeat_count, base.batch_size, base.repeat_count, base.shuffle, base.seed)

    def record_metric(self, name: str, value: float) -> None:
        mode = "train" if self.model.training else "eval"
        self._metrics[mode][name].append(float(value))

    def _prepare_inputs(self, generation_batch):
        if isinstance(generation_batch, PreparedInputs):
            return generation_batch.inputs
        return super()._prepare_inputs(generation_batch)

    def _step_trains(self) -> bool:
        """Whether any micro-batch of the optimizer step starting now has a token with loss (TRL's buffer:
        slice `_step % steps_per_generation` per micro-batch)."""
        per_gen, accum = self.args.steps_per_generation, self.current_gradient_accumulation_steps
        slices = [self._buffered_inputs[(self._step + j) % per_gen] for j in range(accum)]
        return any(bool(loss_mask(b).any()) for b in slices)

    def training_step(self, model, inputs, num_items_in_batch):
        # A step whose every rollout is masked (dynamic sampling found no group with reward spread) must make
        # no update at all: a zero gradient would still move the weights through Adam's moments. The step is
        # decided at its first micro-batch, once its generation batch exists, and then runs no forward and no
        # backward: no gradient exists, so the optimizer skips every weight, and under DeepSpeed (which steps
        # inside `backward`) the engine never steps. One decision for every process (a collective).
        import torch

        model.train()  # as the Trainer's own step does first: TRL buffers generations in train mode only
        t0 = time.perf_counter()
        prepared = PreparedInputs(self._prepare_inputs(inputs))  # TRL generates here when a batch is due
        self._current_train_step_time += time.perf_counter() - t0  # TRL's step_time includes generation
        accum = self.current_gradient_accumulation_steps
        if self._step % accum == 0:
            self._rc_skip = not processes.any_process(self._step_trains())
            self.record_metric("rc/step_skipped", float(self._rc_skip))
        if not self._rc_skip:
            return super().training_step(model, prepared, num_items_in_batch)
        self._step += 1  # TRL's bookkeeping of a step: its micro-step counter schedules the next generation
        if self._step % accum == 0:
            self._metrics["train"]["step_time"].append(self._current_train_step_time)
            self._current_train_step_time = 0.0
        return torch.zeros((), device=self.args.device)

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        # TRL returns this process's share of the advantages; the diagnostics cover the whole batch.
        a = self.accelerator.gather(output["advantages"].detach().float()).cpu().tolist()
        self.last_advantages = a
        self.record_metric("rc/adv_abs_mean", adv.advantage_spread(a))
        self.record_metric("rc/adv_std", adv.advantage_std(a))
        self._rc_offpolicy(output)
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
                    logits_to_keep=last_positions(logits_to_keep + 1, ids.size(1), ids.device))
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


def correct_mismatch(cfg: RLConfig, device_type: str, autocast: bool) -> bool:
    """`rl.importance_sampling` resolved for a run on `device_type` with trainer bf16 `autocast`: `on`, `off`,
    or (`auto`) where the rollouts' numerics differ from the trainer's (`rollout_policy.sampler_differs`)."""
    if cfg.importance_sampling != "auto":
        return cfg.importance_sampling == "on"
    return sampler_differs(cfg.use_vllm, rollout_dtype(cfg.rollout_dtype, device_type), autocast)


def grpo_args(cfg: RLConfig, ckpt_dir: Path, grad_accum: int, device=None):
    """TRL `GRPOConfig` of a run: checkpoints under `ckpt_dir`, no reporting (MLflow goes through callbacks),
    on `device` (`runs.train_device`; None = CUDA when available). `minibatches` optimizer steps per
    generation batch; TRL's importance sampling (its vLLM path) as `correct_mismatch` says, token-truncated
    at `importance_sampling_cap` (the engine path reads the same fields: `build_trainer`)."""
    import torch
    from trl import GRPOConfig

    bf16 = runs.resolve_bf16(cfg.bf16, device)
    device_type = device.type if device is not None else "cuda" if torch.cuda.is_available() else "cpu"
    weights = [1.0 if name == cfg.reward else 0.0 for name in REWARDS]
    kwargs = dict(
        output_dir=str(ckpt_dir), per_device_train_batch_size=cfg.micro_batch_size,
        gradient_accumulation_steps=grad_accum, num_generations=cfg.num_generations, max_steps=cfg.max_steps,
        learning_rate=cfg.learning_rate, lr_scheduler_type=cfg.lr_scheduler, warmup_steps=0, beta=cfg.beta,
        epsilon=cfg.epsilon, num_iterations=cfg.num_iterations, steps_per_generation=cfg.minibatches * grad_accum,
        scale_rewards=cfg.scale_rewards, loss_type=cfg.loss_type, reward_weights=weights,
        temperature=cfg.decode.temperature, top_p=cfg.decode.top_p,
        max_completion_length=cfg.decode.max_new_tokens * cfg.decode.max_outputs, disable_dropout=True,
        gradient_checkpointing=cfg.gradient_checkpointing, logging_steps=1, save_strategy="steps",
        save_steps=cfg.save_steps, save_total_limit=cfg.save_total_limit, report_to=[], seed=cfg.seed,
        data_seed=cfg.seed, remove_unused_columns=False, dataloader_num_workers=0, disable_tqdm=True,
        bf16=bf16, use_cpu=runs.use_cpu(device), deepspeed=cfg.deepspeed, use_vllm=cfg.use_vllm,
        vllm_mode=cfg.vllm_mode, vllm_gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
        vllm_importance_sampling_correction=correct_mismatch(cfg, device_type, bf16),
        vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=cfg.importance_sampling_cap,
    )
    kwargs.update(cfg.extra)
    return GRPOConfig(**kwargs)


# ---------------------------------------------------------------- build and save


def rl_lora(cfg: RLConfig, model, tokenizer, levels: tuple[str, ...], mode: str):
    """The RL LoRA on the merged init; under a reward-token conditioning (`rc`, `fixed`) with the reward
    tokens' embedding rows trainable (PEFT trainable tokens: input and, untied, output rows), as RCTP trains
    them, so RL can move the tokens it conditions on. The reference (adapter disabled) keeps the init rows."""
    from peft import LoraConfig

    ids = [tokenizer.convert_tokens_to_ids(t) for t in levels] if mode != "none" else []
    return LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=runs.lora_targets(cfg.lora_target_modules), task_type="CAUSAL_LM",
                      trainable_token_indices=token_indices(model, ids) if ids else None)


def build_trainer(cfg: RLConfig, protocol: ProtocolConfig, levels: tuple[str, ...], spec: RLRun,
                  callbacks: list | None = None, track: bool = True, device=None, micro_batch: int | None = None):
    """(trainer, checkpoint to resume or None, rollout function) -- everything checked before training.

    `protocol`: the episode settings (params `prompt` + `cfg.decode.max_outputs`); `levels`: the reward tokens
    (label_rewards.tokens); `track`: step metrics to the active MLflow run; `device`: where it trains
    (None = CUDA when available); `micro_batch`: train at this micro-batch instead of
    `cfg.micro_batch_size` (more accumulation, the same batch; the checkpoints stay the run's)."""
    from datasets import Dataset

    mode = spec.mode
    fit = cfg if micro_batch is None else replace(cfg, micro_batch_size=micro_batch)
    grad_accum = check_world(fit, int(os.environ.get("WORLD_SIZE", "1")))
    check_deepspeed(cfg, mode)
    check_reward(cfg, protocol, split_entries(spec.entries, spec.split, "train", cfg.categories))
    model, tokenizer = load_init_model(spec.model_dir, spec.adapter_dir, cfg.dtype)
    check_tokenizer_has_reward_tokens(tokenizer, mode, levels)
    success = sampled_success_rates(read_jsonl(spec.policy)) if spec.policy is not None else None
    entries = train_entries(spec.entries, spec.split, cfg, protocol, tokenizer, success)
    fp = runs.fingerprint(cfg, protocol=as_dict(protocol), levels=list(levels), init=spec.init, algo=spec.algo,
                          mode=mode, code=Path(__file__), entries=Path(spec.entries), split=Path(spec.split),
                          model=Path(spec.model_dir), adapter=spec.adapter_dir and Path(spec.adapter_dir))
    resume = runs.resume_point(spec.checkpoints, fp, run=spec.name)
    rollout = EngineRollout(cfg, protocol, mode, levels, {e.id: e for e in entries}, tokenizer,
                            dynamic=spec.algo == "dynamic")
    # No PEFT under full fine-tuning: TRL builds its reference model from `config._name_or_path`, so that
    # path must BE the init.
    lora = None if cfg.full_finetune else rl_lora(cfg, model, tokenizer, levels, mode)
    model = _init_on_disk(model, tokenizer, spec, cfg.dtype) if cfg.full_finetune or cfg.use_vllm else model
    diagnostics = runs.lazy_subclass(DiagnosticsMixin, "transformers.TrainerCallback")(spec.checkpoints / DIAGNOSTICS_FILE)
    own = [runs.step_metrics(STEP_MARKER, diag_metrics)] if track else []
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is "experimental" in TRL 1.16
    trainer = runs.lazy_subclass(RCGRPOTrainerMixin, "trl.GRPOTrainer")(
        model=model, reward_funcs=reward_funcs(), args=grpo_args(fit, spec.checkpoints, grad_accum, device),
        train_dataset=Dataset.from_list([{"prompt": e.id} for e in entries]), processing_class=tokenizer,
        peft_config=lora, rollout_func=rollout, callbacks=[diagnostics, *own, *(callbacks or [])],
    )
    _finish(trainer, cfg, rollout, lora is not None)
    return trainer, resume, rollout


def _finish(trainer, cfg: RLConfig, rollout: EngineRollout, peft: bool) -> None:
    """What TRL's constructor cannot be told: the engine's end-of-turn ids as EOS ids, TRL's vLLM weight sync
    without PEFT's token deltas (and through vLLM's in-place reload on its CPU build), the engine rollouts'
    importance-sampling cap (TRL's vLLM path corrects itself), PEFT's save and LM-head settings."""
    trainer.eos_token_ids = sorted(set(trainer.eos_token_ids) | rollout.end_ids)
    if cfg.use_vllm:
        skip_token_adapters(trainer.vllm_generation)
        if trainer.vllm_generation.mode == "colocate" and trainer.accelerator.device.type == "cpu":
            reload_in_place(trainer.vllm_generation)  # vLLM's CPU build repacks weights TRL's sync writes into
    correct = trainer.args.vllm_importance_sampling_correction and not cfg.use_vllm
    trainer.rc_importance_cap = cfg.importance_sampling_cap if correct else None
    if peft:
        # The RL LoRA sits on the MERGED init; pointing it at the base folder would make PEFT see the resized
        # vocabulary and store the whole embedding matrix in every checkpoint (~110 MB each, untrained).
        peft_model = trainer.accelerator.unwrap_model(trainer.model)
        peft_model.peft_config["default"].base_model_name_or_path = None
        peft_model.get_base_model().name_or_path = ""  # PEFT refills the field from here on every save
        expose_head_bias(peft_model)  # TRL's fused LM head (GPU) reads lm_head.bias off the token wrapper


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
