"""`RCGRPOConfig`: TRL's `GRPOConfig` plus the fields reward conditioning needs."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import GRPOConfig

from rcgrpo.draw import CONDITIONING_MODES, TOKEN_DRAWS
from rcgrpo.goal import DEFAULT_LEVELS, GOAL_PLACES, GOAL_TEMPLATE, check_levels, check_template, check_thresholds


@dataclass
class RCGRPOConfig(GRPOConfig):
    r"""
    Configuration class for the [`RCGRPOTrainer`], Reward-Conditioned GRPO
    ([RC-GRPO](https://huggingface.co/papers/2602.03025)).

    Every [`~trl.GRPOConfig`] parameter, with its default but one: `beta` defaults to the paper's 0.1 (the KL
    coefficient to the RCTP model; GRPOConfig's is 0.0). The paper's `epsilon=0.2` and `learning_rate=1e-6` are
    GRPOConfig's defaults already. Its G = 5 is not the default: GRPOConfig's batch of 8 does not split into
    groups of 5, so `num_generations=5` goes with a batch that is a multiple of 5; its batch of 256 prompts and 400
    steps are the user's to set. Whatever GRPOConfig accepts, this accepts.

    Parameters:
        > Reward conditioning

        reward_tokens (`list[str]`, *optional*, defaults to `["<|low_reward|>", "<|high_reward|>"]`):
            The reward levels' tokens, lowest first (the paper's two). Add them to the tokenizer and model with
            [`add_reward_tokens`] before RCTP fine-tuning.
        reward_thresholds (`list[float]`, *optional*, defaults to `[0.5]`):
            How a reward maps to a level: `len(reward_tokens) - 1` ascending thresholds; a reward reaching the
            i-th (reward >= t) is at least level i + 1. The highest defines success in the logged metrics and
            labels RCTP data ([`rctp_rows`]).
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
            Where the goal goes in each prompt: `"first_user"` (the paper), `"last_user"`, `"system"`, or
            `"external"` (the prompt is left as it is: a `rollout_func` reads `trainer.reward_tokens`, an
            environment's `reset(**row)` gets the row's `reward_token` and `reward_goal`). A plain-text prompt
            gets the goal at its end.
        eval_reward_token (`str`, *optional*):
            The token evaluation (`eval_dataset`) conditions on; `None`: the highest level (the paper evaluates on
            `<|high_reward|>`). Ignored under `conditioning="none"`.
    """

    beta: float = field(
        default=0.1, metadata={"help": "KL coefficient to the reference (the RCTP model): the paper's 0.1."})

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

    def __post_init__(self):
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
        super().__post_init__()

    @property
    def eval_token(self) -> str:
        """The token evaluation conditions on."""
        return self.eval_reward_token or self.reward_tokens[-1]
