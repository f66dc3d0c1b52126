"""`RCGRPOConfig`: TRL's `GRPOConfig` plus what reward conditioning needs, with the paper's defaults."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import GRPOConfig

from rcgrpo.draw import CONDITIONING_MODES, TOKEN_DRAWS
from rcgrpo.goal import DEFAULT_LEVELS, GOAL_PLACES, GOAL_TEMPLATE, check_levels, check_template, check_thresholds


@dataclass
class RCGRPOConfig(GRPOConfig):
    r"""
    Configuration class for the [`RCGRPOTrainer`]: Reward-Conditioned GRPO (RC-GRPO, arXiv 2602.03025).

    It inherits every parameter of [`~trl.GRPOConfig`] and adds the ones below. Defaults that differ from
    `GRPOConfig`'s are the paper's (`num_generations=5`, `beta=0.1`; `epsilon=0.2` and `learning_rate=1e-6` are
    TRL's defaults already) and `per_device_train_batch_size=10` (two groups of G=5: TRL's 8 is not a multiple of
    5). The paper's batch of 256 prompts and its 400 steps are left to the user.

    Parameters:
        > Reward conditioning

        reward_tokens (`list[str]`, *optional*, defaults to `["<|low_reward|>", "<|high_reward|>"]`):
            The reward levels' tokens, lowest first (the paper's two). Add them to the tokenizer and model with
            [`add_reward_tokens`] before training.
        reward_thresholds (`list[float]`, *optional*, defaults to `[0.5]`):
            How a reward maps to a level: `len(reward_tokens) - 1` ascending thresholds; a reward reaching the
            i-th (reward >= t) is at least level i + 1. The highest threshold defines success in the logged
            metrics (`rc/success_*`, flat at failure / at success) and labels RCTP data ([`rctp_rows`]).
        conditioning (`str`, *optional*, defaults to `"rc"`):
            `"rc"`: RC-GRPO, each rollout draws its own token. `"fixed"`: every rollout is conditioned on the
            highest level (GRPO from an RCTP model). `"none"`: no token; the trainer is then TRL's `GRPOTrainer`.
        p_high (`float`, *optional*, defaults to `0.5`):
            P(highest level) of each rollout's token under `"rc"` (the paper's 0.5); the rest is the lowest level.
            With more than two levels, RL draws the two ends only.
        token_draw (`str`, *optional*, defaults to `"iid"`):
            `"iid"` (the paper: each rollout's own draw) or `"stratified"` (every group holds both tokens, each
            rollout still high with probability `p_high`).
        reward_goal_template (`str`, *optional*, defaults to `"\n\n[Reward Goal: {token}]"`):
            The goal text; `{token}` is replaced by the rollout's token.
        reward_goal_place (`str`, *optional*, defaults to `"first_user"`):
            Where the goal goes in each prompt: `"first_user"` (the paper: the first user message), `"last_user"`,
            `"system"`, or `"external"` (the prompt is left as it is: a `rollout_func` reads
            `trainer.reward_tokens`, an environment's `reset(**row)` gets the row's `reward_token` and may return
            the goal text, which TRL appends to the last message). A plain-text prompt gets the goal at its end.
        eval_reward_token (`str` or `None`, *optional*, defaults to `None`):
            The token evaluation (`eval_dataset`) conditions on; `None`: the highest level (the paper evaluates on
            `<|high_reward|>`). Ignored under `conditioning="none"`.
        reward_token_seed (`int` or `None`, *optional*, defaults to `None`):
            Seed of the token draw; `None`: `seed`. A group's tokens depend on (this seed, the optimizer step, the
            group's index in the step's whole batch), so a resumed run or another number of processes draws the
            same tokens.

        > Options for rollouts that do not come from TRL's generation (off by default: TRL's behaviour)

        epoch_seeded_order (`bool`, *optional*, defaults to `False`):
            Seed each epoch's prompt order by (seed, epoch), so a run resumed in a later epoch trains on the
            same prompts as the uninterrupted run (TRL draws every epoch from one generator).
        skip_steps_without_loss (`bool`, *optional*, defaults to `False`):
            A step whose every completion token is masked (a `rollout_func` returning an all-zero `env_mask`,
            e.g. dynamic sampling that found nothing to learn) makes no update at all: no forward, no backward,
            no optimizer step (a zero gradient would still move weights through Adam's moments).
        fast_cpu_logps (`bool`, *optional*, defaults to `False`):
            On a CPU, project only the attended completion positions through the LM head (TRL 1.16 scores every
            position there); the same log-probs up to float rounding. GPUs and multimodal inputs keep TRL's path.
        shared_prefix_min_tokens (`int` or `None`, *optional*, defaults to `None`):
            With `fast_cpu_logps`: a micro-batch's shared tokens (a group's prompt) go through the model's trunk
            once where that saves at least this many tokens a row; `None`: the padded forward.
        kl_token_max (`float` or `None`, *optional*, defaults to `None`):
            Bound of each token's KL term k3 = exp(d) - d - 1 (d = log pi_ref - log pi): d is clamped to the two
            roots of k3 = this, so one far-off token cannot dominate a step; `None`: TRL's unbounded term.
        rollout_importance_sampling_cap (`float` or `None`, *optional*, defaults to `None`):
            For a `rollout_func` that returns its sampler's log-probs: weight each token's policy loss by
            min(pi_trainer / pi_sampler, cap) (TRL's `token_truncate`, which TRL applies to its own vLLM
            rollouts only); `None`: no correction. The mismatch is logged (`rc/logp_diff_*`, `rc/sampler_kl`)
            whenever the rollouts carry log-probs.
    """

    # Parameters whose defaults differ from GRPOConfig's (the paper's values)
    num_generations: int | None = field(
        default=5, metadata={"help": "Rollouts per prompt, G (the paper's 5)."})
    beta: float = field(
        default=0.1, metadata={"help": "KL coefficient to the reference (the RCTP model): the paper's 0.1."})
    per_device_train_batch_size: int = field(
        default=10, metadata={"help": "Rollouts per device and step: two groups of G=5 (TRL's 8 is not a multiple)."})

    reward_tokens: list[str] = field(
        default_factory=lambda: list(DEFAULT_LEVELS),
        metadata={"help": "The reward levels' tokens, lowest first (the paper's two)."})
    reward_thresholds: list[float] = field(
        default_factory=lambda: [0.5],
        metadata={"help": "Ascending thresholds mapping a reward to a level (len(reward_tokens) - 1 of them)."})
    conditioning: str = field(
        default="rc", metadata={"help": "rc (RC-GRPO), fixed (always the highest level) or none (plain GRPO).",
                                "choices": list(CONDITIONING_MODES)})
    p_high: float = field(default=0.5, metadata={"help": "P(highest level) of each rollout's token under rc."})
    token_draw: str = field(
        default="iid", metadata={"help": "iid (the paper) or stratified (both tokens in every group).",
                                 "choices": list(TOKEN_DRAWS)})
    reward_goal_template: str = field(
        default=GOAL_TEMPLATE, metadata={"help": "The goal text; {token} is replaced by the rollout's token."})
    reward_goal_place: str = field(
        default="first_user", metadata={"help": "Where the goal goes in the prompt.", "choices": list(GOAL_PLACES)})
    eval_reward_token: str | None = field(
        default=None, metadata={"help": "Token evaluation conditions on; None: the highest level."})
    reward_token_seed: int | None = field(
        default=None, metadata={"help": "Seed of the token draw; None: `seed`."})
    epoch_seeded_order: bool = field(
        default=False, metadata={"help": "Seed each epoch's prompt order by (seed, epoch) for exact resumes."})
    skip_steps_without_loss: bool = field(
        default=False, metadata={"help": "A step whose every completion token is masked makes no update."})
    fast_cpu_logps: bool = field(
        default=False, metadata={"help": "On CPU, project only completion positions through the LM head."})
    shared_prefix_min_tokens: int | None = field(
        default=None, metadata={"help": "With fast_cpu_logps: shared prefixes through the trunk once."})
    kl_token_max: float | None = field(
        default=None, metadata={"help": "Bound of each token's KL term; None: TRL's unbounded term."})
    rollout_importance_sampling_cap: float | None = field(
        default=None, metadata={"help": "Truncated importance sampling of rollout_func rollouts; None: off."})

    def __post_init__(self):
        # Checked before GRPOConfig's own checks, which see the derived batch sizes.
        self.reward_tokens = list(check_levels(self.reward_tokens))
        self.reward_thresholds = list(check_thresholds(self.reward_thresholds, len(self.reward_tokens)))
        check_template(self.reward_goal_template)
        for name, allowed in (("conditioning", CONDITIONING_MODES), ("token_draw", TOKEN_DRAWS),
                              ("reward_goal_place", GOAL_PLACES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if not 0.0 < self.p_high < 1.0:
            raise ValueError(f"p_high must be in (0, 1), got {self.p_high}")
        if self.eval_reward_token is not None and self.eval_reward_token not in self.reward_tokens:
            raise ValueError(f"eval_reward_token {self.eval_reward_token!r} is not one of reward_tokens "
                             f"{self.reward_tokens}")
        if self.shared_prefix_min_tokens is not None and (not self.fast_cpu_logps or self.shared_prefix_min_tokens < 0):
            raise ValueError("shared_prefix_min_tokens needs fast_cpu_logps=True and a value >= 0")
        if self.kl_token_max is not None and not self.kl_token_max > 0:
            raise ValueError(f"kl_token_max must be > 0 or None, got {self.kl_token_max}")
        if self.rollout_importance_sampling_cap is not None and not self.rollout_importance_sampling_cap >= 1.0:
            raise ValueError(f"rollout_importance_sampling_cap must be >= 1 (a cap below 1 down-weights every "
                             f"token) or None, got {self.rollout_importance_sampling_cap}")
        super().__post_init__()

    @property
    def eval_token(self) -> str:
        """The token evaluation conditions on."""
        return self.eval_reward_token or self.reward_tokens[-1]
