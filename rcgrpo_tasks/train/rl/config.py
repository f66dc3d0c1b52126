"""GRPO / RC-GRPO settings: what a run is configured with, checked before anything loads. A leaf of `train`:
it imports no training code (`lint-imports`), so what reads a setting does not see the trainer.

- `RLConfig` (params.yaml `rl`), `GuardConfig` (the divergence check's thresholds), `TokenDraw`.
- `check_world`: groups must not straddle processes; `check_reward`: `rl.reward` must be defined for the
  entries under `prompt.protocol`; `check_deepspeed`: ZeRO-3 and LoRA reward-token rows do not mix.
The entries a run samples from are chosen in `pool.py`, the rollout function TRL calls (`EngineRollout`) is in
`rollout.py`, the trainer (`RCGRPOTrainer`, `build_trainer`) in `trainer.py`, one run end to end (`train_rl`) in
`run.py`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import ClassVar, Literal

from rcgrpo.draw import TokenDraw
from rcgrpo_tasks.engine.compute import ComputeConfig, ResolvedCompute, resolve_compute
from rcgrpo_tasks.engine.decoding import DecodeConfig
from rcgrpo_tasks.env.prompt import ProtocolConfig
from rcgrpo_tasks.env.rewards import Reward
from rcgrpo_tasks.env.tasks import task_of
from rcgrpo_tasks.ops.config import ConfigError, flat_field

DECODE_KEYS = ("temperature", "top_p", "max_outputs", "max_new_tokens")


@dataclass(frozen=True)
class GuardConfig:
    """The divergence check's thresholds (params `rl`: `divergence_*`; `kl_guard.divergence`)."""

    max_kl: float | None
    window: int
    min_reward: float


@dataclass(frozen=True, kw_only=True)
class RLConfig:
    MOVED_KEYS: ClassVar[dict[str, str]] = {
        "min_sampled_success": "rl.pool_band (RL's pool: prompts of RL's own side in a band of the init's success)"}

    num_generations: int
    """G: rollouts per entry (group size). Paper: 5."""
    batch_size: int
    """Rollouts per optimizer step (= entries per step x G); must be a multiple of G. Paper: 256 prompts.
    4 groups a step: chosen on the dev split (2 groups lost dev accuracy; docs/rl.md "Chosen on dev")."""
    micro_batch_size: int
    """Rollouts per forward/backward on one device; batch_size must be a multiple (grad accumulation)."""
    max_steps: int
    """Optimizer steps. Paper: 400."""
    learning_rate: float
    """LoRA learning rate (paper, full fine-tuning: 1e-6); chosen on dev together with batch_size."""
    lr_scheduler: str
    """transformers scheduler name."""
    beta: float
    """KL coefficient to the init (SFT/RCTP) model. Paper: 0.1."""
    beta_low: float | None
    """Algo `rc_anchor`: the KL coefficient of the low token's rollouts (the high token's keep `beta`), so the
    low-conditioned policy stays near the init, where it fails (`train.rl.anchor`: 1.0 is the bound at which
    the low condition's KL-regularised optimum keeps q >= 1/2); null: no such algo can run. Other algos ignore it."""
    epsilon: float
    """PPO clip range. Paper: 0.2."""
    num_iterations: int
    """PPO epochs per generation batch (TRL's num_iterations, mu). With 1 (and one minibatch) every update is
    on the batch's own policy: the ratio is 1 and the clip never acts. From 2 on, the later passes train the
    moved policy on the same rollouts and the clip bounds them."""
    minibatches: int
    """Optimizer steps per generation batch, each on its own share (PPO minibatches): one generation of
    minibatches x batch_size rollouts serves that many steps, the later ones off-policy (the clip acts).
    TRL's steps_per_generation = minibatches x gradient accumulation."""
    importance_sampling: Literal["auto", "on", "off"]
    """Token-level truncated importance sampling of the sampler/trainer mismatch, TRL's
    `vllm_importance_sampling_correction` with mode `token_truncate`, for engine rollouts as for vLLM ones:
    each token's policy loss weighted by min(pi_trainer / pi_sampler, cap), the trainer's log-probs taken
    once per generation batch. `auto`: on where the sampler's numerics differ from the trainer's (vLLM, the
    rollout snapshot, bf16 autocast in the trainer only: `rollout_policy.sampler_differs`). The mismatch is
    logged either way."""
    importance_sampling_cap: float
    """Upper bound C of the importance weights (TRL's `vllm_importance_sampling_clip_max`, default 3.0)."""
    scale_rewards: Literal["group", "batch", "none"]
    """TRL advantage scaling: `group` = GRPO's (r - mean) / std over the group."""
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"]
    """TRL loss aggregation; `grpo` = per-sequence token mean, then batch mean (the GRPO paper's)."""
    p_high: float
    """RC-GRPO: P(highest reward token) of each rollout's token. Paper: 0.5."""
    token_draw: TokenDraw
    """RC-GRPO: `iid` (the paper: each rollout draws its own token) or `stratified` (every group holds both
    tokens, each rollout still high with probability p_high: `advantages.stratified_count`)."""
    dynamic_max_rounds: int
    """Algo `dynamic`: generation rounds per step, the first included (dropped groups are refilled in the
    others); groups without reward spread after the last round are not trained on."""
    kl_token_max: float | None
    """Bound of each token's KL term k3 = exp(d) - d - 1 (d = log pi_ref - log pi): d is clamped to the two
    roots of k3 = this (`train.rl.kl.bounded_reference`), so one far-off sampled token cannot dominate a step
    (verl's `low_var_kl` bounds it at 10 too); null = TRL's unbounded term."""
    stop_on_divergence: bool
    """Stop a diverging run and roll its policy back to the last good checkpoint (`kl_guard`): a non-finite
    loss or KL, a mean KL above `divergence_kl`, or the reward at 0 for `divergence_window` steps after a
    window with mean >= `divergence_min_reward`. The summary and the MLflow run name the step."""
    divergence_kl: float | None
    """Mean per-token KL to the init that counts as divergence (null: no KL check)."""
    divergence_window: int
    """Steps of the reward-collapse check."""
    divergence_min_reward: float
    """A reward collapse counts after a window whose mean reward reached this."""
    probe_entries: int
    """K: prompts of the run's pool in the fixed probe (`probe`: scored at step 0, the middle and the end
    with the same seeds in every cell); 0 = no probe."""
    probe_samples: int
    """S: samples per probe prompt (at the rollouts' temperature)."""
    probe_transfer_entries: int
    """K_t: prompts of RL's side outside the pool beside the K pool prompts of the probe (what RL never trains
    on: does learning on the pool transfer?); 0 = the pool half only."""
    reward: Reward
    """Reward that drives the advantage (`env.rewards.Reward`); the other two are logged."""
    decode: DecodeConfig = flat_field(DecodeConfig, DECODE_KEYS,
                                      fixed={"backend": "hf", "dtype": "auto", "batch_rows": 8})
    """How rollouts sample (`engine.decoding`; flat keys: temperature, top_p, max_outputs, max_new_tokens).
    TRL rescales its log-probs with the same temperature. The engine is the trainer's own policy
    (`rollout_dtype`, `use_vllm`), so backend, dtype and batch_rows do not apply."""
    categories: tuple[str, ...] | None
    """Train-split categories to sample entries from; null = every category of the prepared entries."""
    max_entries: int | None
    """Use only this many pool entries (the shortest prompts first); null = all."""
    pool_band: tuple[float, float] | None
    """RL's pool (`pool_ids`): the prompts of RL's side (prepare_data's `rl`; no fine-tuning set holds them)
    whose share of the init's own samples that succeed (sample_policy@pool-<init>, `--pool`) lies in
    [lo, hi]: solved sometimes, GRPO's case (a group of G has spread, something to learn). Never-solved
    prompts give all-0 groups under any token; always-solved ones all-1 groups under one token. Null: every
    prompt of the side (no samples read)."""
    pool_solved_share: float
    """Always-solved prompts (every sample succeeded) added beside the band's, up to this share of the pool
    (drawn by `seed`): RC-GRPO's own case, where a low token can add the spread that all-high groups lack."""
    full_finetune: bool
    """Train every weight (the paper; GPU + DeepSpeed) instead of a LoRA on top of the merged init."""
    lora_r: int
    """Rank of the RL LoRA (on top of the merged init)."""
    lora_alpha: int
    """LoRA alpha."""
    lora_dropout: float
    """LoRA dropout (0: rollouts and training see the same policy)."""
    lora_target_modules: tuple[str, ...]
    """Modules the RL LoRA adapts (or ("all-linear",))."""
    dtype: Literal["float32", "bfloat16", "float16"]
    """Dtype the merged init weights are held in (LoRA weights stay float32)."""
    rollout_dtype: Literal["auto", "live", "float32", "bfloat16"]
    """Rollouts (without vLLM) sample from a merged copy of the policy in this dtype, refreshed every
    generation; `live` = from the training model itself; `auto` = on a CPU a copy in the dtype THE dtype rule
    gives (`engine.dtype`, params `compute.cpu_bf16`), on a GPU live."""
    bf16: bool | None
    """bf16 autocast for the trainer's forward/backward; None = THE dtype rule (`engine.dtype.train_bf16`: on a
    GPU with bf16, on a CPU as params `compute.cpu_bf16` says)."""
    gradient_checkpointing: bool
    """Trade compute for memory (on for 7B on GPU)."""
    shared_prefix_min_tokens: int | None
    """CPU log-probs (policy, reference, trainer): a micro-batch's shared tokens (a group's prompt, up to an
    RC-GRPO reward token) through the trunk once where that saves at least this many tokens a row
    (`engine.shared_prefix`; the same log-probs as the padded forward up to float rounding); null = always the
    padded forward. GPU: TRL's path."""
    save_steps: int
    """Checkpoint every N optimizer steps (resume point)."""
    save_total_limit: int
    """Checkpoints kept."""
    keep_checkpoints: bool
    """Keep the checkpoints after a successful run (default: delete them; the policy is the output)."""
    use_vllm: bool
    """GPU: rollouts on TRL's vLLM engine (`vllm_mode`)."""
    vllm_mode: Literal["colocate", "server"]
    """`colocate` (vLLM inside the trainer processes) or `server` (`trl vllm-serve`)."""
    vllm_gpu_memory_utilization: float
    """colocate: GPU memory fraction for vLLM."""
    deepspeed: str | None = None
    """DeepSpeed JSON (GPU; e.g. configs/ds_zero3.json under `accelerate launch`)."""
    seed: int
    """Seed of LoRA init, entry order, reward tokens, sampling and the pool's always-solved draw."""
    extra: dict = field(default_factory=dict)
    """Extra GRPOConfig keyword arguments (escape hatch, e.g. deepspeed config path, bf16)."""

    def __post_init__(self) -> None:
        if self.pool_band is not None and not (len(self.pool_band) == 2 and 0.0 <= self.pool_band[0]
                                               <= self.pool_band[1] <= 1.0):
            raise ValueError(f"pool_band must be [lo, hi] with 0 <= lo <= hi <= 1, or null, got {self.pool_band}")
        if not 0.0 <= self.pool_solved_share < 1.0:
            raise ValueError(f"pool_solved_share must be in [0, 1), got {self.pool_solved_share}")
        g = self.num_generations
        if g < 2:
            raise ValueError(f"num_generations (G) must be >= 2 for a group advantage, got {g}")
        if not 0.0 < self.p_high < 1.0:
            raise ValueError(f"p_high must be in (0, 1) (exclusive), got {self.p_high}")
        if self.batch_size < g or self.batch_size % g:
            raise ValueError(f"batch_size ({self.batch_size}) must be a positive multiple of num_generations ({g})")
        if self.micro_batch_size < 1 or self.batch_size % self.micro_batch_size:
            raise ValueError(f"batch_size ({self.batch_size}) must be a multiple of micro_batch_size "
                             f"({self.micro_batch_size})")
        if not 1 <= self.dynamic_max_rounds <= 16:
            raise ValueError(f"dynamic_max_rounds must be in [1, 16] (each round is a full generation), got "
                             f"{self.dynamic_max_rounds}")
        if self.kl_token_max is not None and not self.kl_token_max > 0:
            raise ValueError(f"kl_token_max must be > 0 or null, got {self.kl_token_max}")
        if self.divergence_kl is not None and not self.divergence_kl > 0:
            raise ValueError(f"divergence_kl must be > 0 or null, got {self.divergence_kl}")
        if self.probe_transfer_entries < 0:
            raise ValueError(f"probe_transfer_entries must be >= 0, got {self.probe_transfer_entries}")
        if self.probe_entries < 0 or self.probe_samples < 1:
            raise ValueError(f"need probe_entries >= 0 and probe_samples >= 1, got {self.probe_entries}, "
                             f"{self.probe_samples}")
        if self.divergence_window < 1:
            raise ValueError(f"divergence_window must be >= 1, got {self.divergence_window}")
        if self.shared_prefix_min_tokens is not None and self.shared_prefix_min_tokens < 0:
            raise ValueError(f"shared_prefix_min_tokens must be >= 0 or null, got {self.shared_prefix_min_tokens}")
        for name in ("max_steps", "save_steps", "num_iterations", "minibatches", "lora_r"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.beta_low is not None and not self.beta_low > 0:
            raise ValueError(f"beta_low must be > 0 or null, got {self.beta_low}")
        if self.learning_rate <= 0 or self.beta < 0 or not 0 < self.epsilon < 1:
            raise ValueError("need learning_rate > 0, beta >= 0 and 0 < epsilon < 1")
        if self.decode.temperature <= 0:
            raise ValueError("need temperature > 0 (rollouts are sampled)")
        if not self.importance_sampling_cap >= 1.0:
            raise ValueError(f"importance_sampling_cap must be >= 1 (a cap below 1 down-weights every token), "
                             f"got {self.importance_sampling_cap}")
        if self.max_entries is not None and self.max_entries < self.entries_per_generation:
            raise ValueError(f"max_entries ({self.max_entries}) x G < batch_size x minibatches: a generation "
                             f"needs {self.entries_per_generation} distinct entries")

    def compute_for(self, compute: ComputeConfig, device=None, model_dir: Path | None = None) -> ResolvedCompute:
        """THE dtype rule for a run of this config, once (`engine.compute.resolve_compute`): its rollouts
        (`rollout_dtype: auto`: on a CPU the snapshot's dtype as `compute.cpu_bf16` says, on a GPU the live
        model) and its training autocast (`bf16: null`), on `device` (`placement.train_device`)."""
        return resolve_compute(compute, decode=self.rollout_dtype, gpu_decode="live", train=self.bf16, trains=True,
                               model_dir=model_dir, device=device)

    def resolved(self, compute: ResolvedCompute) -> RLConfig:
        """This config with `compute`'s choices made concrete, so the run, its fingerprint and its summary name
        what it computes in (the layers below refuse `auto` / null)."""
        return replace(self, rollout_dtype=compute.decode_dtype, bf16=compute.train_bf16)

    @property
    def guard(self) -> GuardConfig:
        """The divergence check's thresholds (`GuardConfig`)."""
        return GuardConfig(self.divergence_kl, self.divergence_window, self.divergence_min_reward)

    @property
    def entries_per_step(self) -> int:
        return self.batch_size // self.num_generations

    @property
    def entries_per_generation(self) -> int:
        """Distinct entries one generation batch draws (every minibatch's)."""
        return self.entries_per_step * self.minibatches


def check_world(cfg: RLConfig, world_size: int) -> int:
    """Gradient-accumulation steps for `world_size` processes; groups must not straddle processes."""
    per_proc = cfg.batch_size // world_size if cfg.batch_size % world_size == 0 else 0
    if not per_proc or per_proc % cfg.num_generations or per_proc % cfg.micro_batch_size:
        raise ConfigError(f"rl: batch_size {cfg.batch_size} must split into {world_size} process(es) of whole "
                          f"groups (G={cfg.num_generations}) and micro-batches ({cfg.micro_batch_size})")
    return per_proc // cfg.micro_batch_size


def check_deepspeed(cfg: RLConfig, mode: str) -> None:
    """LoRA with trainable reward-token rows (`rc` / `fixed` conditioning) is refused under ZeRO-3: PEFT
    gathers partitioned trainable-token rows on CUDA only, and this path is not tested here. Full fine-tuning
    (the paper's ZeRO-3 setup) trains the rows as part of the embedding. ConfigError naming the fields."""
    if cfg.deepspeed is None or cfg.full_finetune or mode == "none":
        return
    try:
        stage = (json.loads(Path(cfg.deepspeed).read_text()).get("zero_optimization") or {}).get("stage", 0)
    except (OSError, ValueError, AttributeError) as exc:
        raise ConfigError(f"rl.deepspeed: {cfg.deepspeed}: not a readable DeepSpeed JSON ({exc})") from exc
    if stage == 3:
        raise ConfigError(f"rl.deepspeed: {cfg.deepspeed} is ZeRO-3 and rl.full_finetune is false: the LoRA's "
                          f"reward-token rows (conditioning {mode!r}) cannot be trained on partitioned embeddings "
                          "here; use rl.full_finetune: true, or a ZeRO-2 config")


def check_reward(cfg: RLConfig, protocol: ProtocolConfig, entries) -> None:
    """`rl.reward` must be defined for the entries under `prompt.protocol` (`Task.reward_defined`): the
    multi-turn task's paper protocol merges every turn into one episode, where the official verdict and the
    per-turn credit are always 0, so RL would silently be a KL-only no-op. ConfigError naming both fields."""
    for task in {task_of(e) for e in entries}:
        if not task.reward_defined(cfg.reward, protocol.protocol):
            raise ConfigError(f"rl.reward: {cfg.reward} is not defined for {task.name} entries under "
                              f"prompt.protocol: {protocol.protocol} (every reward would be 0: RL a KL-only "
                              f"no-op); use rl.reward: paper_reward, or prompt.protocol: official")
