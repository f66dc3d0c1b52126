"""`RCGRPOTrainer`: TRL's `GRPOTrainer` where every rollout is conditioned on its own reward token.

What it adds to a GRPO step, and nothing else (generation, rewards, advantages, loss, KL and clipping are TRL's):
1. Before generation, each rollout of the batch draws its reward token (`draw.batch_tokens`: i.i.d. with
   P(high) = `p_high` under `conditioning="rc"`, the highest level under `"fixed"`, none under `"none"`;
   evaluation batches get `eval_reward_token`) and its prompt gets the goal text at `reward_goal_place`
   (`goal.place_goal`). The row also gets a `reward_token` column, which reward functions receive as a keyword
   argument and an environment's `reset(**row)` as a column; a `rollout_func` reads `trainer.reward_tokens`.
2. TRL then generates from the conditioned prompts and computes the advantage over each whole group, whatever
   token each rollout drew: that is RC-GRPO's advantage (TRL's `view(-1, G)` groups the G consecutive rows of
   one prompt; the tokens never enter it).
3. After scoring, the generation's metrics (`group_metrics.generation_metrics`: the zero-variance share split
   flat-at-failure / flat-at-success, reward and success per token, the token gap, rollouts with a non-zero
   advantage per token) go into TRL's own step metrics, so `report_to` sends them wherever TRL's go;
   `trainer.last_generation` holds the batch's tokens, rewards and advantages for callbacks.
With `conditioning="none"` and the options below off, the trainer is TRL's `GRPOTrainer` (tests compare
generated ids, rewards, advantages, loss and gradients).

Resume: a checkpoint inside a generation batch (`steps_per_generation` or `num_iterations` > 1) also holds
TRL's buffered batch and micro-step counter (`resume.GenerationStateMixin`), so a resumed run trains what the
uninterrupted one trains, bit for bit where the kernels are deterministic.

Options for rollouts that do not come from TRL's generation (`RCGRPOConfig`, off by default): the epoch-seeded
prompt order, steps without loss skipped, CPU log-probs on completion positions only (and shared prefixes),
the bounded KL term, truncated importance sampling of a `rollout_func`'s rollouts (`offpolicy`).

Private TRL methods it wraps through `super()` (TRL >= 1.16, < 1.17; `_check_trl` fails early on another
version): `_generate_and_score_completions`, `_calculate_rewards`, `_get_train_sampler`, `_prepare_inputs`,
`_compute_loss`, `_get_per_token_logps_and_entropies`, and the Trainer's `_save_rng_state` / `_load_rng_state`
(TRL's `_step` and `_buffered_inputs` read and restored there). vLLM's `server` mode under TRL's own generation
decodes one prompt per group (`prompts[::G]`), which would give every rollout of an RC-GRPO group the first
rollout's token: refused (a `rollout_func` gets every row's prompt: allowed).
"""

from __future__ import annotations

import os
import textwrap
import time
from dataclasses import asdict, dataclass

import torch
import trl
from packaging.version import Version
from trl import GRPOTrainer
from trl.trainer.utils import RepeatSampler

from rcgrpo.config import RCGRPOConfig
from rcgrpo.draw import batch_tokens
from rcgrpo.goal import format_goal, place_goal
from rcgrpo.group_metrics import generation_metrics
from rcgrpo.kl import bounded_reference, kl_bounds
from rcgrpo.logps import completion_logps
from rcgrpo.offpolicy import OffPolicyMixin, loss_mask
from rcgrpo.resume import GenerationStateMixin
from rcgrpo.tokens import embedding_rows, expose_head_bias

TRL_RANGE = (Version("1.16.0"), Version("1.17.0"))
"""The TRL versions whose private methods this trainer wraps (tested at 1.16.0)."""


def _check_trl() -> None:
    version = Version(trl.__version__)
    if not TRL_RANGE[0] <= version < TRL_RANGE[1] and os.environ.get("RCGRPO_ANY_TRL") != "1":
        raise ImportError(f"rcgrpo's trainer wraps private methods of TRL {TRL_RANGE[0]} to < {TRL_RANGE[1]}; "
                          f"installed: trl {version} (set RCGRPO_ANY_TRL=1 to try it anyway)")


@dataclass(frozen=True)
class Generation:
    """One scored generation batch as the advantage saw it: every process's rollouts in batch order."""

    step: int
    reward_tokens: tuple[str | None, ...]
    rewards: tuple[float, ...]
    advantages: tuple[float, ...]


class EpochSeededSampler(RepeatSampler):
    """TRL's `RepeatSampler` with each epoch's prompt order seeded by (seed, epoch): TRL draws every epoch's
    order from one generator seeded once, and a resumed run skips the finished epochs without iterating them,
    so from its first new epoch on it would train on other prompts than the uninterrupted run. The Trainer
    calls `set_epoch` at the start of every epoch (through accelerate's sharded loaders too)."""

    def set_epoch(self, epoch: int) -> None:
        if self.shuffle:
            self.generator.manual_seed((self.seed or 0) * 1_000_003 + epoch)


class _Prepared:
    """A micro-batch `training_step` already took from TRL's buffer (`_prepare_inputs` hands it through)."""

    def __init__(self, inputs: dict):
        self.inputs = inputs


def check_reward_tokens(tokenizer, levels) -> None:
    """Each level must be one token of `tokenizer` (an RCTP model has them; `add_reward_tokens` adds them):
    otherwise the goal would be text the model never learned to read. ValueError naming the missing ones."""
    missing = [t for t in levels if len(tokenizer(t, add_special_tokens=False)["input_ids"]) != 1
               or tokenizer.convert_tokens_to_ids(t) in (None, tokenizer.unk_token_id)]
    if missing:
        raise ValueError(f"reward tokens {missing} are not single tokens of the tokenizer: start RC-GRPO from an RCTP "
                         f"model (docs/library.md), or call rcgrpo.add_reward_tokens(model, tokenizer) first")


def check_reference_rows(ref_model, model) -> None:
    """TRL loads a full fine-tune's KL reference from the model's path: a model whose reward tokens were added in
    memory and not saved gets a reference without their rows (an index error at the first KL term). ValueError
    saying what to do instead. Rows counted as `tokens.embedding_rows` counts them (ZeRO-3's full shape)."""
    ref_rows, rows = embedding_rows(ref_model), embedding_rows(model)
    if ref_rows < rows:
        raise ValueError(f"the KL reference TRL loaded from {model.config._name_or_path!r} has {ref_rows} "
                         f"embedding rows, the model {rows}: save the RCTP model (with its reward tokens) and "
                         f"pass its path, train a PEFT adapter (the reference is then the adapter disabled), or set "
                         f"beta=0.0")


class RCGRPOTrainer(OffPolicyMixin, GenerationStateMixin, GRPOTrainer):
    """Reward-Conditioned GRPO (arXiv 2602.03025) on TRL's `GRPOTrainer`, called exactly like it (module
    docstring). `args` must be an [`RCGRPOConfig`]; `None` builds one named after the model."""

    _tag_names = ["trl", "rc-grpo"]
    _name = "RC-GRPO"
    _paper = {
        "title": "Reward-Conditioned GRPO (RC-GRPO)",
        "id": "2602.03025",
        "citation": textwrap.dedent("""\
            @article{rcgrpo2026,
                title        = {{Reward-Conditioned GRPO (RC-GRPO)}},
                year         = 2026,
                eprint       = {arXiv:2602.03025},
            }"""),
    }

    def __init__(self, model, reward_funcs=None, args: RCGRPOConfig | None = None, train_dataset=None,
                 eval_dataset=None, processing_class=None, reward_processing_classes=None, callbacks=None,
                 optimizers=(None, None), quantization_config=None, peft_config=None, tools=None, rollout_func=None,
                 environment_factory=None):
        _check_trl()
        if args is None:
            name = model if isinstance(model, str) else (model.config._name_or_path or "model")
            args = RCGRPOConfig(f"{name.split('/')[-1]}-RCGRPO")
        if not isinstance(args, RCGRPOConfig):
            raise TypeError(f"RCGRPOTrainer needs an RCGRPOConfig (it carries the reward conditioning), got "
                            f"{type(args).__name__}")
        if args.conditioning == "rc" and args.use_vllm and args.vllm_mode == "server" and rollout_func is None:
            raise NotImplementedError("vLLM server mode decodes one prompt per group (prompts[::G]), so every rollout "
                                      "of a group would get its first rollout's reward token: use vllm_mode='colocate', "
                                      "TRL's transformers generation, or a rollout_func (it gets every row's prompt)")
        if args.rollout_importance_sampling_cap is not None and args.use_vllm:
            raise ValueError("rollout_importance_sampling_cap corrects rollout_func rollouts; TRL corrects vLLM's "
                             "itself (vllm_importance_sampling_correction)")
        super().__init__(model=model, reward_funcs=reward_funcs, args=args, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class,
                         reward_processing_classes=reward_processing_classes, callbacks=callbacks, optimizers=optimizers,
                         quantization_config=quantization_config, peft_config=peft_config, tools=tools,
                         rollout_func=rollout_func, environment_factory=environment_factory)
        if args.conditioning != "none":
            check_reward_tokens(self._tokenizer, args.reward_tokens)
        if self.ref_model is not None:
            check_reference_rows(self.ref_model, self.accelerator.unwrap_model(self.model))
        self.reward_tokens: list[str | None] = []
        """This process's rollouts' tokens in the latest generation batch, in row order (empty under `none`)."""
        self.last_generation: Generation | None = None
        """The latest scored generation batch (`Generation`), every process's rollouts."""
        if hasattr(self.accelerator.unwrap_model(self.model), "peft_config"):
            expose_head_bias(self.accelerator.unwrap_model(self.model))  # PEFT trainable tokens under TRL's fused head
        self.rc_importance_cap = args.rollout_importance_sampling_cap
        self._rc_kl = kl_bounds(args.kl_token_max) if args.kl_token_max is not None else None
        self._rc_skip = False

    # ------------------------------------------------------------------ conditioning and its metrics

    def draw_reward_tokens(self, rows: int, mode: str = "train") -> list[str | None] | None:
        """Tokens of this process's `rows` rollouts of the generation batch about to be generated (None under
        `conditioning="none"`): evaluation's token, or the seeded draw of (seed, step, each row's group)."""
        a = self.args
        if a.conditioning == "none":
            return None
        if mode == "eval":
            return [a.eval_token] * rows
        seed = a.seed if a.reward_token_seed is None else a.reward_token_seed
        return batch_tokens(rows, self.num_generations, a.conditioning, a.p_high, seed, self.state.global_step,
                            levels=a.reward_tokens, draw=a.token_draw, first_row=self.accelerator.process_index * rows)

    def condition_row(self, row: dict, token: str | None) -> dict:
        """A copy of a dataset row conditioned on `token`: its `reward_token` column, and the goal text either in
        its prompt (the configured place) or, under `external` (or for a row without a prompt: an environment
        supplies it), in a `reward_goal` column for the rollout function or the environment's `reset` to place;
        `reward_goal` is '' when the prompt carries the goal already, so an environment never adds it twice."""
        goal = format_goal(token, self.args.reward_goal_template)
        if self.args.reward_goal_place == "external" or "prompt" not in row:
            return {**row, "reward_token": token, "reward_goal": goal}
        return {**row, "reward_token": token, "reward_goal": "",
                "prompt": place_goal(row["prompt"], goal, self.args.reward_goal_place)}

    def _in_flight_extras(self) -> dict:
        last = self.last_generation
        return {"reward_tokens": list(self.reward_tokens), "last_generation": asdict(last) if last else None}

    def _restore_in_flight_extras(self, extras: dict) -> None:
        self.reward_tokens = list(extras["reward_tokens"])
        last = extras["last_generation"]
        self.last_generation = Generation(**{k: tuple(v) if isinstance(v, list) else v for k, v in last.items()}) \
            if last else None

    def record_metric(self, name: str, value: float) -> None:
        """Add a value, already reduced across processes, to the current step's metrics (averaged in `log`)."""
        self._metrics["train" if self.model.training else "eval"][name].append(float(value))

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._rc_rewards_per_func = rewards_per_func  # every process's rows (TRL gathers them)
        return rewards_per_func

    def _generate_and_score_completions(self, inputs):
        from accelerate.utils import gather_object

        mode = "train" if self.model.training else "eval"
        tokens = self.draw_reward_tokens(len(inputs), mode)
        self.reward_tokens = list(tokens or [])
        if tokens is not None:
            inputs = [self.condition_row(x, t) for x, t in zip(inputs, tokens, strict=True)]
        output = super()._generate_and_score_completions(inputs)
        # The tokens the rollouts carry now: a rollout function may return its own (`reward_token` extra field).
        mine = [x.get("reward_token") for x in inputs]
        all_tokens = gather_object(mine) if self.accelerator.num_processes > 1 else mine
        rpf = self._rc_rewards_per_func
        rewards = (rpf * self.reward_weights.to(rpf.device).unsqueeze(0)).nansum(dim=1)
        rewards[torch.isnan(rpf).all(dim=1)] = torch.nan  # unscorable rows, as TRL's own log
        advantages = self.accelerator.gather(output["advantages"].detach().float()).cpu().tolist()
        g = self.num_generations if mode == "train" else self.num_generations_eval
        rewards = rewards.cpu().tolist()
        for name, value in generation_metrics(rewards, all_tokens, advantages, g, levels=self.args.reward_tokens,
                                              thresholds=self.args.reward_thresholds).items():
            self.record_metric(name, value)
        self.last_generation = Generation(self.state.global_step, tuple(all_tokens), tuple(rewards), tuple(advantages))
        self._rc_offpolicy(output)
        return output

    # ------------------------------------------------------------------ options (RCGRPOConfig, off by default)

    def _get_train_sampler(self, dataset=None):
        base = super()._get_train_sampler(dataset)
        if not self.args.epoch_seeded_order:
            return base
        return EpochSeededSampler(base.data_source, base.mini_repeat_count, base.batch_size, base.repeat_count,
                                  base.shuffle, base.seed)

    def _prepare_inputs(self, generation_batch):
        if isinstance(generation_batch, _Prepared):
            return generation_batch.inputs
        return super()._prepare_inputs(generation_batch)

    def _step_trains(self) -> bool:
        """Whether any micro-batch of the optimizer step starting now has a token with loss (TRL's buffer:
        slice `_step % steps_per_generation` per micro-batch)."""
        per_gen, accum = self.args.steps_per_generation, self.current_gradient_accumulation_steps
        slices = [self._buffered_inputs[(self._step + j) % per_gen] for j in range(accum)]
        return any(bool(loss_mask(b).any()) for b in slices)

    def training_step(self, model, inputs, num_items_in_batch):
        accum = self.current_gradient_accumulation_steps
        if not self.args.skip_steps_without_loss:
            loss = super().training_step(model, inputs, num_items_in_batch)
        else:
            # A step whose every rollout is masked must make no update: a zero gradient would still move the
            # weights through Adam's moments. Decided at the step's first micro-batch, once its generation batch
            # exists; then no forward and no backward run (DeepSpeed, which steps inside `backward`, never steps).
            # One decision for every process (a collective).
            model.train()  # as the Trainer's own step does first: TRL buffers generations in train mode only
            t0 = time.perf_counter()
            prepared = _Prepared(self._prepare_inputs(inputs))  # TRL generates here when a batch is due
            self._current_train_step_time += time.perf_counter() - t0  # TRL's step_time includes generation
            if self._step % accum == 0:
                flag = torch.tensor(float(self._step_trains()), device=self.accelerator.device)
                self._rc_skip = not bool(self.accelerator.reduce(flag, reduction="sum").item())
                self.record_metric("rc/step_skipped", float(self._rc_skip))
            if not self._rc_skip:
                loss = super().training_step(model, prepared, num_items_in_batch)
            else:
                self._step += 1  # TRL's bookkeeping: its micro-step counter schedules the next generation
                if self._step % accum == 0:
                    self._metrics["train"]["step_time"].append(self._current_train_step_time)
                    self._current_train_step_time = 0.0
                loss = torch.zeros((), device=self.args.device)
        if self._step % accum == 0:
            self._rc_flush()  # the mismatch the step's loss forwards measured (`offpolicy`)
        return loss

    def _compute_loss(self, model, inputs):
        # The KL bound: TRL reads the reference log-probs after the policy's; the log-probs call below fills this
        # clone with the bounded reference (`kl.bounded_reference`) before TRL reads it.
        if self._rc_kl is not None and self.beta != 0.0 and "ref_per_token_logps" in inputs:
            ref = inputs["ref_per_token_logps"].clone()
            inputs = {**inputs, "ref_per_token_logps": ref}
            self._rc_kl_pending = ref
        self._rc_loss_inputs = inputs  # the next log-probs call is the loss's own forward of the policy
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self._rc_kl_pending = self._rc_loss_inputs = None

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **multimodal):
        fast = (self.args.fast_cpu_logps and input_ids.device.type == "cpu" and not compute_aux_loss
                and all(v is None for v in multimodal.values()))
        if fast:
            wrapped = self.accelerator.unwrap_model(model) is not model  # DDP / DeepSpeed: their forward syncs grads
            with self.accelerator.autocast():
                out = completion_logps(model, input_ids, attention_mask, logits_to_keep, self.temperature,
                                       batch_size or input_ids.size(0), compute_entropy,
                                       None if wrapped else self.args.shared_prefix_min_tokens,
                                       self.processing_class.pad_token_id or 0)
        else:
            out = super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep,
                                                             batch_size, compute_entropy, compute_aux_loss,
                                                             **multimodal)
        loss_inputs, self._rc_loss_inputs = getattr(self, "_rc_loss_inputs", None), None
        if loss_inputs is not None:  # the loss's own call: the mismatch from this forward (`offpolicy`)
            self._rc_measure(out[0], loss_inputs)
        pending = getattr(self, "_rc_kl_pending", None)
        if pending is not None:  # the loss's own call: bound the reference against these log-probs
            self._rc_kl_pending = None
            pending.copy_(bounded_reference(pending, out[0], *self._rc_kl))
        return out

    def _rc_metric(self, name: str, value: float) -> None:
        self.record_metric(name, value)
