"""Controllability of a reward-conditioned model: E[R|high] - E[R|low] as RL samples it (the controllability stage runs `measure`)."""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

from rcgrpo.controllability import gap_stats, per_unit, q_stats
from rcgrpo.stats import check_n_boot, mean
from rcgrpo_tasks.data.margin import REPLAY_OUTPUTS, read_token
from rcgrpo_tasks.engine.backend import SamplingParams, reward_pair_ids
from rcgrpo_tasks.engine.decoding import DecodeConfig
from rcgrpo_tasks.engine.hf import HFBackend
from rcgrpo_tasks.engine.rollout import run_groups
from rcgrpo_tasks.env.entries import check_categories, split_entries, stratified
from rcgrpo_tasks.env.failures import FAILURE_KINDS
from rcgrpo_tasks.env.prompt import PromptConfig
from rcgrpo_tasks.env.tasks import task_of, task_of_entries
from rcgrpo_tasks.evaluation.accuracy import RLSampling, check_side
from rcgrpo_tasks.evaluation.stats import paired_bootstrap_ci
from rcgrpo_tasks.ops.config import flat_field
from rcgrpo_tasks.ops.inputs import InputError

DECODE_KEYS = ("max_outputs", "max_new_tokens", "batch_rows", "dtype")


@dataclass(frozen=True)
class ControllabilityConfig:
    MOVED_KEYS: ClassVar[dict[str, str]] = {
        k: f"rl.{k} (the sampled arm samples as RL does)" for k in ("temperature", "top_p")}

    decode: DecodeConfig = flat_field(DecodeConfig, DECODE_KEYS,
                                      fixed={"backend": "hf", "temperature": 1.0, "top_p": 1.0})
    """Budgets and engine (`engine.decoding`; flat keys: max_outputs, max_new_tokens, batch_rows, dtype). The
    sampled arm's temperature and top_p are `rl`'s (`sampled_as` replaces the fixed placeholders); the backend
    is hf, loaded as evaluate loads a trained output."""
    side: Literal["test", "dev"]
    """The side of the split the check reads (`test`: held out; `dev`: what designs are chosen on, so the
    premise gate reads entries nothing reports); the stage's `--side` overrides it (the dev sweep's)."""
    n_entries: int
    """Entries rolled: the first n of `side` taken round-robin over `categories`."""
    categories: tuple[str, ...] | None
    """Categories drawn from; null = every category of the prepared entries."""
    samples_per_token: int
    """Sampled arm: rollouts per (entry, token) at the RL temperature."""
    greedy: bool
    """Also roll one greedy rollout per (entry, token) beside the sampled arm."""
    seed: int
    """Sampling and bootstrap seed."""
    n_bootstrap: int
    """Bootstrap resamples of every CI."""
    margin: bool
    """Also the teacher-forced margin (`data.margin`: forward passes only) and the reward-token rows'
    distance; the margin on `margin_entries` held-out entries."""
    margin_entries: int | None
    """Held-out entries of the margin (round-robin over `categories`); null = every held-out entry."""
    margin_kinds: tuple[str, ...] | None
    """Near-miss kinds of the margin; null = every kind the task knows."""
    premise_min_q: float
    """RC-GRPO's premise gate (`premise_gate`): the sampled arm's q (P(low fails | high succeeds), paired
    rollouts) at least this, and its sampled gap's 95 % CI above 0. RCTP's design target."""
    guidance: float
    """> 0: a third arm, `guided`: the sampled arm again with reward-token guidance of this scale
    (`SamplingParams.guidance`; each token pushed further toward its own goal), same seeds, so its gap
    sits beside the unguided one. 0 = no guided arm."""

    def __post_init__(self) -> None:
        if self.guidance < 0:
            raise ValueError("guidance must be >= 0")
        if not 0.0 <= self.premise_min_q <= 1.0:
            raise ValueError(f"premise_min_q must lie in [0, 1], got {self.premise_min_q}")
        check_categories(self.categories)
        if self.margin_entries is not None and self.margin_entries < 1:
            raise ValueError("margin_entries must be >= 1 or null (every held-out entry)")
        if self.n_entries < 1 or self.samples_per_token < 1:
            raise ValueError("n_entries and samples_per_token must be >= 1")
        if self.decode.batch_rows < 2:
            raise ValueError("batch_rows must be >= 2 (a row and its other-token twin)")
        check_n_boot(self.n_bootstrap)

    def sampled_as(self, rl: RLSampling) -> ControllabilityConfig:
        """This config with the sampled arm at `rl`'s temperature and top_p (the check mirrors RL)."""
        return dataclasses.replace(self, decode=rl.applied(self.decode))


@dataclass(frozen=True)
class RLGroups:
    """RL's groups as the zero-variance shares assume them: params `rl`'s `num_generations` (G) and `p_high`,
    read key by key (`ops.config.load_keys`), not through the RL trainer's config."""

    num_generations: int
    """G: rollouts per entry."""
    p_high: float
    """RC-GRPO: P(highest reward token) of a rollout's token."""

    def __post_init__(self) -> None:
        if self.num_generations < 2 or not 0.0 < self.p_high < 1.0:
            raise ValueError("need num_generations >= 2 and 0 < p_high < 1")


def rl_record(sampling: RLSampling, groups: RLGroups) -> dict:
    """The RL settings the check mirrors, as recorded beside its metrics."""
    return {"temperature": sampling.temperature, "top_p": sampling.top_p,
            "num_generations": groups.num_generations, "p_high": groups.p_high}


def held_out_entries(entries_path: Path, split_path: Path, cfg: ControllabilityConfig,
                     n: int | None = -1, side: str = "test") -> list:
    """The first `n` (default `n_entries`; None = all) entries of `side` (test: what is reported; dev: what
    designs are chosen on) in `cfg.categories`, round-robin over the categories (file order within each), as
    evaluate's `limit` takes them."""
    rows = split_entries(entries_path, split_path, check_side(side), cfg.categories)
    if not rows:
        raise InputError(f"{split_path}: no {side} entries in categories {list(cfg.categories or [])} (empty: any)")
    return stratified(rows, cfg.n_entries if n == -1 else (n or len(rows)))


def reading(cfg: ControllabilityConfig, backend, entries: list, prompt: PromptConfig, tokens: tuple[str, str]) -> dict:
    """Does the model read its token, from forward passes (`data.margin.read_token`) on `entries`, in float32
    whatever the decoding dtype (`HFBackend.exact_model`)."""
    return read_token(backend.exact_model(), backend.tokenizer, entries, prompt.protocol_config(REPLAY_OUTPUTS), tokens,
                      cfg.margin_kinds, cfg.seed, cfg.n_bootstrap, backend.max_positions)


# ----------------------------------------------------------------------------------------------------
# Statistics (pure)


def zero_variance_share(p_h: float, p_l: float, g: int, q: float) -> tuple[float, float]:
    """(all-high, mixed): P(all G rewards of a group are equal) for one entry with success rates p_h under
    the high token and p_l under the low one; mixed = each rollout's token i.i.d. high with P = q."""
    all_high = p_h ** g + (1 - p_h) ** g
    mixed = sum(math.comb(g, k) * q ** k * (1 - q) ** (g - k)
                * (p_h ** k * p_l ** (g - k) + (1 - p_h) ** k * (1 - p_l) ** (g - k)) for k in range(g + 1))
    return all_high, mixed


def zero_variance_stats(rates_high: list[float], rates_low: list[float], g: int, q: float, n_boot: int = 2000,
                        seed: int = 0) -> dict:
    """Mean zero-variance share over entries under all-high vs mixed tokens and the paired CI of the change."""
    shares = [zero_variance_share(h, w, g, q) for h, w in zip(rates_high, rates_low)]
    all_high, mixed = [a for a, _ in shares], [m for _, m in shares]
    diff, lo, hi = paired_bootstrap_ci(mixed, all_high, n_boot=n_boot, seed=seed)
    return {"G": g, "p_high": q, "n_entries": len(shares), "all_high": mean(all_high), "mixed": mean(mixed),
            "mixed_minus_all_high": diff, "mixed_minus_all_high_ci": [lo, hi]}


def paired_rewards(trajs: list, high: str, low: str) -> dict[str, list[tuple[float, float]]]:
    """Per entry, the (high, low) paper rewards of its paired rollouts: the i-th under each token share a
    row seed (`arm`), in first-seen entry order."""
    said: dict[tuple[str, str], list[float]] = {}
    for t in trajs:
        said.setdefault((t.entry_id, t.reward_token), []).append(float(t.score["paper_reward"]))
    return {entry: list(zip(rs, said.get((entry, low), []))) for (entry, token), rs in said.items() if token == high}


def premise_gate(sampled: dict, min_q: float) -> dict:
    """Does the model read its token as RC-GRPO needs (the sampled arm's stats)? `passed` when q >= `min_q`
    and the sampled gap's CI lies above 0; `why` names what failed."""
    q, lo = sampled["premise"]["q"], sampled["gap_ci"][0]
    missed = ([f"q {q:.3f} < {min_q}"] if not q >= min_q else []) + ([f"sampled gap CI low {lo:+.3f} <= 0"]
                                                                     if not lo > 0 else [])
    return {"min_q": min_q, "q": q, "gap_ci_low": lo, "passed": not missed, "why": "; ".join(missed) or "met"}


def failure_kinds(trajs: list, entries: list, high: str, low: str) -> dict:
    """What each token's failures are made of (`env.failures`: a failure is a paper reward of 0), and q split by
    the low rollout's kind: `q_by_kind[k]` = P(low fails with kind k | high succeeds) over the paired
    rollouts (the i-th under each token), so the kinds' q add up to q. A low side that fails in prose
    (`no_call`) is a contrast of format; wrong calls are one of content."""
    by_id = {e.id: e for e in entries}

    def kind(t) -> str | None:
        e = by_id[t.entry_id]
        return task_of(e).failure_kind(e, t.result, float(t.score["paper_reward"]) == 1.0)

    said: dict[tuple[str, str], list] = {}
    for t in trajs:
        said.setdefault((t.entry_id, t.reward_token), []).append(t)
    counts = {tok: dict.fromkeys(FAILURE_KINDS, 0) for tok in ("high", "low")}
    for t in trajs:
        k = kind(t)
        if k is not None and t.reward_token in (high, low):
            counts["high" if t.reward_token == high else "low"][k] += 1
    pairs = [(h, w) for (entry, token), hs in said.items() if token == high for h, w in zip(hs, said.get((entry, low), []))]
    wins = [w for h, w in pairs if kind(h) is None]
    by_kind = {k: sum(kind(w) == k for w in wins) for k in FAILURE_KINDS}
    return {"failures_high": counts["high"], "failures_low": counts["low"], "high_successes": len(wins),
            "q_by_kind": {k: n / len(wins) if wins else float("nan") for k, n in by_kind.items()}}


def per_entry_rewards(trajs: list, high: str, low: str) -> dict[str, list[float]]:
    """{entry: [mean paper reward | high, mean | low]} for the entries sampled under both tokens, in first-seen
    order: the units the token gap's endpoint pairs across models (`evaluation.endpoints`)."""
    pairs = paired_rewards(trajs, high, low)
    return {e: [sum(h for h, _ in ps) / len(ps), sum(w for _, w in ps) / len(ps)] for e, ps in pairs.items() if ps}


def identical_outputs(trajs: list, high: str, low: str) -> int:
    """Paired rollouts (same entry, same row seed: the i-th under each token) whose assistant messages are
    the same under both tokens: the token changed nothing. Greedy: one pair per entry."""
    said: dict[tuple[str, str], list[list[str]]] = {}
    for t in trajs:
        said.setdefault((t.entry_id, t.reward_token), []).append(
            [m["content"] for m in t.messages if m["role"] == "assistant"])
    return sum(h == w for (entry, token), highs in said.items() if token == high
               for h, w in zip(highs, said.get((entry, low), [])))


# ----------------------------------------------------------------------------------------------------
# Rolling


def load_policy(model_dir: Path, adapter_dir: Path | None, dtype: str, tokens: tuple[str, ...], device: str = "auto"):
    """HF backend over the trained model on `device`, loaded exactly as `evaluate` loads it (`HFBackend`:
    adapter merged in float32, then cast to `dtype`), so the gap is measured on the model evaluate_rctp scores."""
    backend = HFBackend(model_dir, adapter_dir, dtype=dtype, device=device)
    for t in tokens:
        if len(backend.tokenizer(t, add_special_tokens=False)["input_ids"]) != 1:
            raise InputError(f"{adapter_dir or model_dir}: {t} is not a single token; use an sft-stage output")
    return backend


def arm(cfg: ControllabilityConfig, backend, entries: list, proto, sampling: SamplingParams, k: int,
        tokens: tuple[str, str], provenance: dict) -> tuple[dict, list]:
    """(stats, trajectories) of k rollouts per (entry, token): high first, then low, per entry.

    Common random numbers: the i-th rollout under either token samples with the same row seed (one group
    per token, both seeded by the entry: `run_groups`), so the paired gap differs only through the token
    and `identical_outputs` counts the pairs the token did not change."""
    high, low = tokens
    groups = [(e, [t] * k) for e in entries for t in (high, low)]
    done = run_groups(backend, groups, proto, sampling, provenance, cfg.decode.batch_rows)
    trajs = [t for group in done for t in group]
    scores = [{"entry_id": t.entry_id, "reward_token": t.reward_token, **t.score} for t in trajs]
    reward = gap_stats(scores, high, low, "paper_reward", cfg.n_bootstrap, cfg.seed)
    partial = gap_stats(scores, high, low, "partial_credit", cfg.n_bootstrap, cfg.seed)
    stats = {"temperature": sampling.temperature, "top_p": sampling.top_p, "samples_per_token": k,
             "success_rate_high": reward["high"], "success_rate_low": reward["low"], "gap": reward["gap"],
             "gap_se": reward["gap_se"], "gap_ci": reward["gap_ci"],
             "partial_credit_high": partial["high"], "partial_credit_low": partial["low"],
             "partial_credit_gap": partial["gap"], "partial_credit_gap_ci": partial["gap_ci"],
             "model_tokens_high": mean([t.n_model_tokens for t in trajs if t.reward_token == high]),
             "model_tokens_low": mean([t.n_model_tokens for t in trajs if t.reward_token == low]),
             "pairs": len(entries) * k, "identical_outputs": identical_outputs(trajs, high, low),
             "premise": q_stats(paired_rewards(trajs, high, low), cfg.n_bootstrap, cfg.seed),
             **failure_kinds(trajs, entries, high, low), "per_entry": per_entry_rewards(trajs, high, low)}
    return stats, trajs


def measure(cfg: ControllabilityConfig, prompt: PromptConfig, tokens: tuple[str, ...], backend, entries: list,
            rl: RLSampling, groups: RLGroups, provenance: dict | None = None,
            margin_entries: list | None = None) -> tuple[dict, list]:
    """(metrics, trajectories): the sampled arm at RL's sampling settings `rl`, the greedy arm, the
    zero-variance shares of `groups.num_generations`-sized groups under `groups.p_high`; with `cfg.margin`, the
    teacher-forced margin on `margin_entries` (default: `entries`) and the token rows' distance (`reading`)."""
    high, low = tokens[-1], tokens[0]
    cfg = cfg.sampled_as(rl)
    proto = prompt.protocol_config(cfg.decode.max_outputs)
    prov = {"source": "controllability", **(provenance or {})}
    t0 = time.perf_counter()
    metrics: dict = {"task": task_of_entries(entries).name, "n_entries": len(entries), "high_token": high,
                     "low_token": low, "entries": [e.id for e in entries]}
    trajs: list = []
    if cfg.greedy:
        greedy = dataclasses.replace(cfg.decode, temperature=0.0, top_p=1.0).sampling(cfg.seed)
        metrics["greedy"], g_trajs = arm(cfg, backend, entries, proto, greedy, 1, (high, low), {**prov, "arm": "greedy"})
        trajs += g_trajs
    sampling = cfg.decode.sampling(cfg.seed)
    metrics["sampled"], s_trajs = arm(cfg, backend, entries, proto, sampling, cfg.samples_per_token, (high, low),
                                      {**prov, "arm": "sampled"})
    trajs += s_trajs
    if cfg.guidance:
        guided = dataclasses.replace(sampling, guidance=cfg.guidance,
                                     guidance_pair=reward_pair_ids(backend.tokenizer, (high, low)))
        metrics["guided"], g_trajs = arm(cfg, backend, entries, proto, guided, cfg.samples_per_token, (high, low),
                                         {**prov, "arm": "guided", "guidance": cfg.guidance})
        metrics["guided"]["guidance"] = cfg.guidance
        trajs += g_trajs
    metrics["premise_gate"] = premise_gate(metrics["sampled"], cfg.premise_min_q)
    scores = [{"entry_id": t.entry_id, "reward_token": t.reward_token, **t.score} for t in s_trajs]
    _, _, rates_high, rates_low = per_unit(scores, high, low, "paper_reward")
    metrics["zero_variance"] = zero_variance_stats(rates_high, rates_low, groups.num_generations, groups.p_high,
                                                   cfg.n_bootstrap, cfg.seed)
    metrics["rollout_s"] = round(time.perf_counter() - t0, 2)
    if cfg.margin:
        t1 = time.perf_counter()
        metrics.update(reading(cfg, backend, margin_entries or entries, prompt, (high, low)))
        metrics["margin_s"] = round(time.perf_counter() - t1, 2)
    return metrics, trajs
