"""What the rl stage hands its trainer (`pipeline_trainer.PipelineTrainer`: the library's `rcgrpo.RCGRPOTrainer`
with the pipeline's options): its config and options (`trainer_args`), its reward functions (`reward_funcs`) and
the log of every rollout (`RolloutLogMixin`, a callback); `trainer.build_trainer` builds it with the engine's
rollout function (docs/rl.md).

- Rewards: one TRL reward function per `env.rewards.REWARDS`, reading the scores the engine computed
  (`EngineRollout.to_trl`'s `r_<name>` columns); one-hot `reward_weights` pick `cfg.reward`.
- The pipeline's options (`pipeline_trainer.Options`): shared prefixes (`shared_prefix_min_tokens`), the KL
  bound (`kl_token_max`), the engine rollouts' importance-sampling cap (`correct_mismatch`), `rc_anchor`'s
  `beta_low`, `rc_frozen`'s frozen token rows; the epoch-seeded order, skipped steps without loss and CPU
  log-probs on completion positions always. The goal is the engine's to place (`reward_goal_place: external`):
  the trainer draws each rollout's token and the engine renders the episode with it.
"""

from __future__ import annotations

import json
from pathlib import Path

from rcgrpo_tasks.env.rewards import REWARDS
from rcgrpo_tasks.ops.inputs import read_jsonl
from rcgrpo_tasks.train.common import placement
from rcgrpo_tasks.train.rl.config import RLConfig
from rcgrpo_tasks.train.rl.pipeline_trainer import Options
from rcgrpo_tasks.train.rl.rollout_policy import rollout_dtype, sampler_differs

ROLLOUTS_FILE = "rollouts.jsonl"
"""Every rollout of the run, one JSON line each (`rollout.rollout_record` + its advantage), in the
checkpoint folder: which entries, tokens, rewards and advantages each step trained on, whatever the process
count."""


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
    return sampler_differs(cfg.use_vllm, rollout_dtype(cfg.rollout_dtype), autocast)


def trainer_args(cfg: RLConfig, mode: str, levels: tuple[str, ...], ckpt_dir: Path, grad_accum: int, algo: str,
                 device=None):
    """(`rcgrpo.RCGRPOConfig`, `pipeline_trainer.Options`) of a run: `mode` (`rc` / `fixed` / `none`: the cell's
    conditioning), the reward tokens `levels` and the cell's `algo`; checkpoints under `ckpt_dir`; no reporting
    (MLflow goes through callbacks); on `device` (`placement.train_device`; None = CUDA when available).
    `minibatches` optimizer steps per generation batch; the sampler/trainer mismatch corrected as
    `correct_mismatch` says (TRL's own for its vLLM rollouts, the pipeline trainer's for the engine's),
    token-truncated at `importance_sampling_cap`."""
    import torch

    from rcgrpo.config import RCGRPOConfig

    bf16 = placement.resolved_bf16(cfg.bf16)
    device_type = device.type if device is not None else "cuda" if torch.cuda.is_available() else "cpu"
    correct = correct_mismatch(cfg, device_type, bf16)
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
        bf16=bf16, use_cpu=placement.use_cpu(device), deepspeed=cfg.deepspeed, use_vllm=cfg.use_vllm,
        vllm_mode=cfg.vllm_mode, vllm_gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
        vllm_importance_sampling_correction=correct and cfg.use_vllm,
        vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=cfg.importance_sampling_cap,
        # reward conditioning: the cell's, the engine places the goal
        reward_tokens=list(levels), conditioning=mode, p_high=cfg.p_high, token_draw=cfg.token_draw,
        reward_goal_place="external",
    )
    kwargs.update(cfg.extra)
    options = Options(shared_prefix_min_tokens=cfg.shared_prefix_min_tokens, kl_token_max=cfg.kl_token_max,
                      importance_sampling_cap=cfg.importance_sampling_cap if correct and not cfg.use_vllm else None,
                      beta_low=cfg.beta_low if algo == "rc_anchor" else None, train_token_rows=algo != "rc_frozen")
    return RCGRPOConfig(**kwargs), options


class RolloutLogMixin:
    """A `TrainerCallback` (`callbacks.lazy_subclass`) appending every generation's rollouts to ROLLOUTS_FILE in
    the checkpoint folder: the rollout function's records (`EngineRollout.records`, every process's, batch order)
    with the advantage the trainer used (`trainer.last_generation`). The first write of a run (or of a resumed
    run) drops the rows of the steps it redoes. `trainer` is set after the trainer is built."""

    def __init__(self, folder: Path):
        self.path = Path(folder) / ROLLOUTS_FILE
        self.trainer = None
        self._opened = False
        self._last = None

    def on_step_end(self, args, state, control, **kwargs):
        gen = self.trainer.last_generation if self.trainer is not None else None
        records = getattr(self.trainer.rollout_func, "records", None) if gen is not None else None
        if gen is None or gen is self._last or not records or len(records) != len(gen.advantages):
            return
        self._last = gen
        if self.trainer.accelerator.is_main_process:
            self._write([{**r, "advantage": a} for r, a in zip(records, gen.advantages)])

    def _write(self, rows: list[dict]) -> None:
        step = rows[0]["step"]
        if not self._opened:
            kept = [r for r in read_jsonl(self.path) if r["step"] < step] if self.path.is_file() else []
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in kept))
            self._opened = True
        with self.path.open("a") as fh:
            fh.writelines(json.dumps(r, sort_keys=True) + "\n" for r in rows)
