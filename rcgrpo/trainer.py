"""`RCGRPOTrainer`: TRL's `GRPOTrainer` where every rollout is conditioned on its own reward token.

What it adds to a GRPO step (generation, advantages, loss, KL and clipping are TRL's):
1. Before generation each rollout draws its token (`draw.batch_tokens`: i.i.d. with P(high) = `p_high` under
   `"rc"`, seeded by (seed, step, the group's index in the step's whole batch), so a resumed run and any number of
   processes draw the same; the highest level under `"fixed"`; `eval_reward_token` in evaluation) and its prompt
   gets the goal text at `reward_goal_place`. The row gets `reward_token` and `reward_goal` columns (the goal text
   a rollout function or environment still has to place; '' when the prompt carries it).
2. Rewards see the user's prompt: reward functions and reward models get each prompt with the goal taken out
   again (`goal.remove_goal`); the token reaches them as the `reward_token` column.
3. TRL's advantage over each whole group, whatever token each rollout drew: RC-GRPO's advantage.
4. The batch's `rc/*` metrics (`group_metrics.generation_metrics`) join TRL's logged metrics (`eval_` prefixed in
   evaluation); `last_generation` / `last_eval_generation` hold the latest batch of each mode for callbacks.
At construction: a `peft_config` gets the reward tokens' rows among its trainable tokens
(`tokens.with_reward_token_rows`); reward tokens whose rows are one vector (added, never RCTP-trained) are
warned about; vLLM `server` mode under TRL's own generation is refused (it decodes `prompts[::G]`, one prompt
per group, so every rollout of a group would get its first rollout's token). `conditioning="none"` is TRL's
`GRPOTrainer` (tests compare ids, rewards, advantages, loss and gradients).

Two private TRL methods are overridden, both through `super()` (pyproject caps TRL at the minor it is tested
with, 1.16):
- `_generate_and_score_completions`: the one place that sees a generation batch's rows before generation, with
  the step known (the draw is seeded by it), and after scoring, with the advantages (the metrics). A dataset
  transform sees one row at a time, without the step or the row's place in its group; callbacks see neither.
- `_calculate_rewards`: where TRL hands the prompts to reward functions and renders reward models' inputs;
  no public hook sits between the conditioned prompt TRL generated from and the reward. It also keeps the
  batch's per-function rewards for step 4.
"""

from __future__ import annotations

import math
import warnings
from collections import defaultdict
from dataclasses import dataclass

import torch
from trl import GRPOTrainer

from rcgrpo.config import RCGRPOConfig
from rcgrpo.draw import batch_tokens
from rcgrpo.goal import format_goal, place_goal, remove_goal
from rcgrpo.group_metrics import generation_metrics
from rcgrpo.tokens import (
    check_reference_rows,
    check_reward_tokens,
    expose_head_bias,
    identical_token_rows,
    text_tokenizer,
    with_reward_token_rows,
)


@dataclass(frozen=True)
class Generation:
    """One scored generation batch as the advantage saw it: every process's rollouts in batch order."""

    step: int
    mode: str
    reward_tokens: tuple[str | None, ...]
    rewards: tuple[float, ...]
    advantages: tuple[float, ...]


class RCGRPOTrainer(GRPOTrainer):
    """Reward-Conditioned GRPO on TRL's `GRPOTrainer`, called exactly like it (module docstring). `args` is an
    [`RCGRPOConfig`]; `None` builds one named after the model."""

    _tag_names = ["trl", "rc-grpo"]
    _name = "RC-GRPO"
    _paper = {
        "title": "RC-GRPO: Reward-Conditioned Group Relative Policy Optimization for Multi-Turn Tool Calling Agents",
        "id": "2602.03025",
        "citation": """\
@article{zhong2026rcgrpo,
    title        = {{RC-GRPO: Reward-Conditioned Group Relative Policy Optimization for Multi-Turn Tool Calling Agents}},
    author       = {Haitian Zhong and Jixiu Zhai and Lei Song and Jiang Bian and Qiang Liu and Tieniu Tan},
    year         = 2026,
    eprint       = {arXiv:2602.03025},
}""",
    }

    def __init__(self, model, reward_funcs=None, args: RCGRPOConfig | None = None, train_dataset=None,
                 eval_dataset=None, processing_class=None, reward_processing_classes=None, callbacks=None,
                 optimizers=(None, None), quantization_config=None, peft_config=None, tools=None, rollout_func=None,
                 environment_factory=None):
        if args is None:
            name = model if isinstance(model, str) else (model.config._name_or_path or "model")
            args = RCGRPOConfig(f"{name.split('/')[-1]}-RCGRPO")
        if not isinstance(args, RCGRPOConfig):
            raise TypeError(f"RCGRPOTrainer takes an RCGRPOConfig (it carries the reward conditioning), got "
                            f"{type(args).__name__}: RCGRPOConfig(**your_config.to_dict()) keeps every value")
        if args.conditioning == "rc" and args.use_vllm and args.vllm_mode == "server" and rollout_func is None:
            raise NotImplementedError("vLLM server mode decodes one prompt per group (prompts[::G]), so every rollout "
                                      "of a group would get its first rollout's reward token: use vllm_mode='colocate', "
                                      "TRL's transformers generation, or a rollout_func (it gets every row's prompt)")
        if peft_config is not None and args.conditioning != "none":
            peft_config = self.reward_token_peft_config(peft_config, model, processing_class, args)
        super().__init__(model=model, reward_funcs=reward_funcs, args=args, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class,
                         reward_processing_classes=reward_processing_classes, callbacks=callbacks, optimizers=optimizers,
                         quantization_config=quantization_config, peft_config=peft_config, tools=tools,
                         rollout_func=rollout_func, environment_factory=environment_factory)
        policy = self.accelerator.unwrap_model(self.model)
        if args.conditioning != "none":
            ids = check_reward_tokens(text_tokenizer(self.processing_class), args.reward_tokens)
            cosine = identical_token_rows(policy, ids)
            if cosine is not None:
                warnings.warn(f"the reward tokens' embedding rows are one vector (cosine {cosine:.8f}): the model "
                              f"cannot tell {args.reward_tokens[0]} from {args.reward_tokens[-1]}. They were added "
                              "(add_reward_tokens) and never trained: fine-tune the model on RCTP rows first "
                              "(rcgrpo.rctp_rows, docs/library.md), or add them with init='apart'", stacklevel=2)
        if self.ref_model is not None:
            check_reference_rows(self.ref_model, policy)
        if hasattr(policy, "peft_config"):
            expose_head_bias(policy)  # PEFT trainable tokens under TRL's fused LM head
        self.reward_tokens: list[str | None] = []
        """This process's rollouts' tokens in the generation batch being generated, in row order (what a
        `rollout_func` reads; empty under `none`)."""
        self.last_generation: Generation | None = None
        """The latest scored training batch, every process's rollouts."""
        self.last_eval_generation: Generation | None = None
        """The latest scored evaluation batch."""
        self.rc_metrics: dict[str, dict[str, list[float]]] = {"train": defaultdict(list), "eval": defaultdict(list)}
        """The `rc/*` values of each mode since the last log, averaged into it (`log`)."""
        self._rc_rewards = None

    def reward_token_peft_config(self, peft_config, model, processing_class, args: RCGRPOConfig):
        """The `peft_config` the policy is wrapped with: the user's, with the reward tokens' embedding rows added
        to its trainable tokens (`tokens.with_reward_token_rows`), so RL can move what the tokens mean, as full
        fine-tuning does. A subclass that must keep the rows frozen returns `peft_config` itself."""
        return with_reward_token_rows(peft_config, model, processing_class, args.reward_tokens)

    def draw_reward_tokens(self, rows: int, mode: str = "train") -> list[str | None] | None:
        """Tokens of this process's `rows` rollouts of the generation batch about to be generated (None under
        `conditioning="none"`): evaluation's token, or the seeded draw of (seed, step, each row's group)."""
        a = self.args
        if a.conditioning == "none":
            return None
        if mode == "eval":
            return [a.eval_token] * rows
        return batch_tokens(rows, self.num_generations, a.conditioning, a.p_high, a.seed, self.state.global_step,
                            levels=a.reward_tokens, draw=a.token_draw, first_row=self.accelerator.process_index * rows)

    def condition_row(self, row: dict, token: str | None) -> dict:
        """A copy of a dataset row conditioned on `token`: its `reward_token` column, and the goal either in its
        prompt (the configured place) or, under `external` (or for a row without a prompt: an environment
        supplies it), in its `reward_goal` column for the rollout function or the environment's `reset` to place
        ('' when the prompt carries it, so an environment never adds it twice)."""
        goal = format_goal(token, self.args.reward_goal_template)
        if self.args.reward_goal_place == "external" or "prompt" not in row:
            return {**row, "reward_token": token, "reward_goal": goal}
        return {**row, "reward_token": token, "reward_goal": "",
                "prompt": place_goal(row["prompt"], goal, self.args.reward_goal_place)}

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        if self.args.conditioning != "none":
            template = self.args.reward_goal_template
            prompts = [remove_goal(p, format_goal(x.get("reward_token"), template)) for p, x in zip(prompts, inputs)]
        self._rc_rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        return self._rc_rewards  # every process's rows (TRL gathers them)

    def _generate_and_score_completions(self, inputs):
        mode = "train" if self.model.training else "eval"
        tokens = self.draw_reward_tokens(len(inputs), mode)
        self.reward_tokens = list(tokens or [])
        if tokens is not None:
            inputs = [self.condition_row(x, t) for x, t in zip(inputs, tokens, strict=True)]
        output = super()._generate_and_score_completions(inputs)
        self._record(mode, [x.get("reward_token") for x in inputs], output["advantages"])
        return output

    def _record(self, mode: str, tokens: list, advantages) -> None:
        """The batch's `rc/*` metrics and its `Generation`, from every process's rows: the tokens the rollouts
        carry (a rollout function may return its own `reward_token`), TRL's rewards and advantages."""
        from accelerate.utils import gather_object

        all_tokens = gather_object(tokens) if self.accelerator.num_processes > 1 else tokens
        per_func, self._rc_rewards = self._rc_rewards, None
        rewards = (per_func * self.reward_weights.to(per_func.device).unsqueeze(0)).nansum(dim=1)
        rewards[torch.isnan(per_func).all(dim=1)] = torch.nan  # unscorable rows, as TRL's own log
        rewards = rewards.cpu().tolist()
        adv = self.accelerator.gather(advantages.detach().float()).cpu().tolist()
        g = self.num_generations if mode == "train" else self.num_generations_eval
        for name, value in generation_metrics(rewards, all_tokens, adv, g, levels=self.args.reward_tokens,
                                              thresholds=self.args.reward_thresholds).items():
            self.rc_metrics[mode][name].append(float(value))
        gen = Generation(self.state.global_step, mode, tuple(all_tokens), tuple(rewards), tuple(adv))
        if mode == "train":
            self.last_generation = gen
        else:
            self.last_eval_generation = gen

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "train" if self.model.training else "eval"
        prefix = "eval_" if mode == "eval" else ""
        for name, values in self.rc_metrics[mode].items():  # averaged as TRL averages its own: NaN left out
            valid = [v for v in values if not math.isnan(v)]
            logs[prefix + name] = sum(valid) / len(valid) if valid else None
        self.rc_metrics[mode].clear()
        super().log(logs, start_time)
