"""Does a reward-conditioned model read its token? RC-GRPO's premise, measured on any model, prompts and reward.

RC-GRPO adds learning signal only if, on the same prompt, the low token fails where the high token succeeds:
- q = P(low fails | high succeeds) over PAIRED samples: the k-th sample of a prompt under each token is drawn
  with the same sampling seed, so the token is the only difference between the two;
- the sampled gap = mean reward | high - mean reward | low, paired over prompts, with a bootstrap CI.
A premise that holds (q well above 0, the gap's CI above 0) is what makes a mixed-token group less often flat
than an all-high one. `q_stats` / `gap_stats` are the pure statistics (the pipeline's controllability stage
calls them on its own rollouts); `measure_controllability` samples a transformers model and scores it with
TRL-style reward functions.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence

from rcgrpo.goal import DEFAULT_LEVELS, GOAL_TEMPLATE, check_levels, format_goal, place_goal
from rcgrpo.stats import mcnemar_exact, mean, paired_bootstrap_ci


def q_stats(pairs: Mapping[str, Sequence[tuple[float, float]]], n_boot: int = 2000, seed: int = 0) -> dict:
    """q = P(low fails | high succeeds) over paired outcomes {unit: [(high success, low success), ...]} (truthy
    = success), with a 95 % CI from resampling units (the ratio of the resampled sums; NaN bounds when too few
    resamples leave a high success to divide by), and the discordant pairs with their exact McNemar p
    (`high_only`: success under high only; `low_only`: under low only)."""
    flat = [(h, w) for ps in pairs.values() for h, w in ps]
    high_wins = sum(1 for h, _w in flat if h)
    high_only = sum(1 for h, w in flat if h and not w)
    low_only = sum(1 for h, w in flat if w and not h)
    per = [(sum(1 for h, w in ps if h and not w), sum(1 for h, _w in ps if h)) for ps in pairs.values()]
    rng, ratios = random.Random(seed), []
    for _ in range(n_boot if per else 0):
        draw = [per[rng.randrange(len(per))] for _ in per]
        den = sum(d for _, d in draw)
        if den:
            ratios.append(sum(a for a, _ in draw) / den)
    ratios.sort()
    ci = ([ratios[int(0.025 * len(ratios))], ratios[min(len(ratios) - 1, int(math.ceil(0.975 * len(ratios))) - 1)]]
          if len(ratios) >= 0.9 * n_boot else [float("nan"), float("nan")])
    return {"q": high_only / high_wins if high_wins else float("nan"), "q_ci": ci, "pairs": len(flat),
            "high_successes": high_wins, "high_only": high_only, "low_only": low_only,
            "mcnemar_p": mcnemar_exact(high_only, low_only)}


def per_unit(scores: Sequence[Mapping], high: str, low: str, key: str, unit: str = "entry_id"
             ) -> tuple[list[float], list[float], list[float], list[float]]:
    """(all high values, all low values, per-unit mean high, per-unit mean low) of `key` in `scores` (dicts with
    `unit`, `reward_token` and `key`); the per-unit lists hold only units sampled under both tokens, in
    first-seen order."""
    by_unit: dict[str, dict[str, list[float]]] = {}
    for s in scores:
        by_unit.setdefault(s[unit], {}).setdefault(s["reward_token"], []).append(float(s[key]))
    highs = [v for per in by_unit.values() for v in per.get(high, [])]
    lows = [v for per in by_unit.values() for v in per.get(low, [])]
    paired = [(sum(p[high]) / len(p[high]), sum(p[low]) / len(p[low])) for p in by_unit.values()
              if p.get(high) and p.get(low)]
    return highs, lows, [h for h, _ in paired], [w for _, w in paired]


def gap_stats(scores: Sequence[Mapping], high: str, low: str, key: str, n_boot: int = 2000, seed: int = 0,
              unit: str = "entry_id") -> dict:
    """Mean of `key` per token, the gap paired over units with its standard error and 95 % bootstrap CI."""
    highs, lows, eh, el = per_unit(scores, high, low, key, unit)
    gap, lo, hi = paired_bootstrap_ci(eh, el, n_boot=n_boot, seed=seed)
    diffs = [h - w for h, w in zip(eh, el)]
    se = (math.sqrt(sum((d - gap) ** 2 for d in diffs) / (len(diffs) - 1) / len(diffs))
          if len(diffs) > 1 else float("nan"))
    return {"high": mean(highs), "low": mean(lows), "gap": gap, "gap_se": se, "gap_ci": [lo, hi]}


def _score(reward_funcs: Sequence[Callable], weights: Sequence[float], prompts: list, completions: list,
           completion_ids: list, columns: dict) -> list[float]:
    """TRL's reward: each function called as f(prompts=, completions=, completion_ids=, **columns), None ->
    skipped, the weighted sum of the rest (NaN when every function returned None)."""
    outs = [f(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
            for f in reward_funcs]
    total = []
    for i in range(len(prompts)):
        vals = [(w, o[i]) for w, o in zip(weights, outs) if o[i] is not None]
        total.append(sum(w * float(v) for w, v in vals) if vals else float("nan"))
    return total


def measure_controllability(model, tokenizer, rows: Sequence[Mapping], reward_funcs: Callable | Sequence[Callable], *,
                            tokens: Sequence[str] = DEFAULT_LEVELS, threshold: float = 0.5, samples: int = 4,
                            seed: int = 0, temperature: float = 0.7, top_p: float = 1.0, max_new_tokens: int = 256,
                            place: str = "first_user", template: str = GOAL_TEMPLATE,
                            reward_weights: Sequence[float] | None = None, n_boot: int = 2000) -> dict:
    """Sample `model` on each row's `prompt` (plain text or conversational, as TRL takes it) `samples` times under
    the highest and the lowest token, the k-th sample of a row under both tokens with the same seed, score every
    completion with `reward_funcs` (TRL's signature; the row's other columns are passed as keyword arguments)
    and return the premise: q and its CI (`q_stats`), the sampled gap and its CI (`gap_stats` over rows),
    success per token (reward >= `threshold`) and the pair counts. Decoding: transformers `generate`, one
    sequence at a time (a per-sample seed needs its own generator state; a batched generate would pair nothing).
    """
    import torch

    levels = check_levels(tokens)
    high, low = levels[-1], levels[0]
    funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    weights = list(reward_weights) if reward_weights is not None else [1.0] * len(funcs)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    scores, pairs = [], {}
    try:
        for r, row in enumerate(rows):
            for k in range(samples):
                got = {}
                for token in (high, low):
                    prompt = place_goal(row["prompt"], format_goal(token, template), place)
                    text = prompt if isinstance(prompt, str) else tokenizer.apply_chat_template(
                        prompt, tokenize=False, add_generation_prompt=True)
                    ids = tokenizer(text, return_tensors="pt", add_special_tokens=isinstance(prompt, str)).to(device)
                    torch.manual_seed(seed * 1_000_003 + r * 1_009 + k)  # the same seed under both tokens
                    with torch.no_grad():
                        out = model.generate(**ids, do_sample=True, temperature=temperature, top_p=top_p,
                                             max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id
                                             or tokenizer.eos_token_id)
                    cids = out[0, ids["input_ids"].shape[1]:].tolist()
                    completion = tokenizer.decode(cids, skip_special_tokens=True)
                    if not isinstance(prompt, str):
                        completion = [{"role": "assistant", "content": completion}]
                    columns = {c: [v] for c, v in row.items() if c not in ("prompt", "completion")}
                    reward = _score(funcs, weights, [prompt], [completion], [cids], {**columns, "reward_token": [token]})[0]
                    got[token] = reward
                    scores.append({"unit": str(r), "reward_token": token, "reward": reward})
                pairs.setdefault(str(r), []).append((got[high] >= threshold, got[low] >= threshold))
    finally:
        model.train(was_training)
    gap = gap_stats(scores, high, low, "reward", n_boot=n_boot, seed=seed, unit="unit")
    q = q_stats(pairs, n_boot=n_boot, seed=seed)
    hs = [h for ps in pairs.values() for h, _ in ps]
    ls = [w for ps in pairs.values() for _, w in ps]
    return {**q, **gap, "success_high": mean([float(x) for x in hs]), "success_low": mean([float(x) for x in ls]),
            "rows": len(rows), "samples": samples}
