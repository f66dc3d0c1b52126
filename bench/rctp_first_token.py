"""Does an RCTP model route its answer on its reward token, on the rows it was trained on?

For every low-token row of an RCTP set (`data/datasets/rctp.jsonl` or a `--data` file), the log-probability
of the row's first answer token with the reward goal it was trained under (low) and with the goal swapped
to the high token, under a model folder (an rctp@<seed> output: `--model`). A model that reads its token puts
several nats more on its low answers under low; one that learned only the low side's marginal puts the same
under both. Prints one JSON line: rows, mean lp under low, mean (low - high) and its range, per failure
source (the base model's prose answers, whose trajectory ids carry `.policy.`, and the other failures).
Forward passes only. Measured: docs/rl.md, "The low side and the token's form".

Run: `python bench/rctp_first_token.py --model models/rctp/0 [--data data/datasets/rctp.jsonl]
[--tokens "<|low_reward|>" "<|high_reward|>"] [--limit 40]`
"""

from __future__ import annotations

import argparse
import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rcgrpo_tasks.data.chat import assistant_token_mask


def _with_goal(messages: list[dict], old: str, new: str) -> list[dict]:
    """The chat with its first user message's reward goal `old` replaced by `new`."""
    out = json.loads(json.dumps(messages))
    user = next(m for m in out if m["role"] == "user")
    suffix = f"[Reward Goal: {old}]"
    if not user["content"].endswith(suffix):
        raise ValueError(f"first user message does not end with {suffix!r}")
    user["content"] = user["content"][: -len(suffix)] + f"[Reward Goal: {new}]"
    return out


def first_token_lp(model, tokenizer, messages: list[dict]) -> float:
    """lp of the first assistant token of `messages` given everything before it."""
    ids, mask = assistant_token_mask(tokenizer, messages)
    at = mask.index(1)
    with torch.no_grad():
        logits = model(torch.tensor([ids[:at]])).logits[0, -1]
    return float(torch.log_softmax(logits.float(), -1)[ids[at]])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", default="data/datasets/rctp.jsonl")
    ap.add_argument("--tokens", nargs=2, default=["<|low_reward|>", "<|high_reward|>"])
    ap.add_argument("--limit", type=int, default=40)
    args = ap.parse_args()
    low, high = args.tokens
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    rows = [json.loads(line) for line in open(args.data) if line.strip()]
    rows = [r for r in rows if r["reward_token"] == low][: args.limit]
    by: dict[str, list[tuple[float, float]]] = {}
    for row in rows:
        source = "base_prose" if ".policy." in row["trajectory_id"] else "own_or_near_miss"
        under_low = first_token_lp(model, tokenizer, row["messages"])
        under_high = first_token_lp(model, tokenizer, _with_goal(row["messages"], low, high))
        by.setdefault(source, []).append((under_low, under_high))
    out = {"model": args.model, "data": args.data, "rows": len(rows)}
    for source, pairs in sorted(by.items()):
        diffs = [a - b for a, b in pairs]
        out[source] = {"n": len(pairs), "lp_low": round(sum(a for a, _ in pairs) / len(pairs), 3),
                       "low_minus_high": round(sum(diffs) / len(diffs), 3),
                       "range": [round(min(diffs), 3), round(max(diffs), 3)]}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
