"""Two stages that decode the same model greedily on the same entries under the same token must give the same
answers: the report compares them entry by entry (controllability's greedy arm under the high token beside
`evaluate_rctp@<seed>`) and fails on a disagreement.

They batch differently (controllability decodes each entry beside its other-token twin, evaluate 16 entries
to a session), so they agree only if decoding does not depend on how rows are batched; a cache that lost a
row's keys, a prompt rendered two ways, or a different model folder shows up here as answers that differ.
What batching may legitimately change is float rounding: two answers may part at a token where the greedy
choice was a near-tie. An entry's answers therefore count as:
- `identical`: the same tokens, each token's log-prob within `tol` of the other run's;
- `tie`: they part at some token, every log-prob before it within `tol`, and there the two chosen tokens'
  log-probs within `tol` of each other (both were the argmax of nearly the same distribution);
- `disagree`: anything else (a log-prob off by more than `tol` before or at the parting token).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from rcgrpo_tasks.engine.trajectory import Trajectory, read_trajectories
from rcgrpo_tasks.ops.inputs import InputError, read_json

TOL = {"float32": 1e-3, "bfloat16": 0.1}
"""Log-prob tolerance (nat) by the decoding dtype: float32 rounding across batch shapes is ~1e-5, bf16's
~1e-2 (its logits carry 8 bits of mantissa)."""


def answer(t: Trajectory) -> tuple[list[int], list[float]]:
    """The model's tokens of a trajectory and their log-probs (the completion-masked positions)."""
    picked = [(tok, lp) for tok, m, lp in zip(t.token_ids, t.completion_mask, t.logprobs) if m]
    return [tok for tok, _ in picked], [lp for _, lp in picked]


def verdict(a: Trajectory, b: Trajectory, tol: float) -> str:
    """identical | tie | disagree for two greedy trajectories of the same entry (see the module docstring)."""
    (ta, la), (tb, lb) = answer(a), answer(b)
    j = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
    shared = min(len(ta), len(tb)) if j is None else j
    if any(abs(x - y) > tol for x, y in zip(la[:shared], lb[:shared])):
        return "disagree"
    if j is None:
        return "identical" if len(ta) == len(tb) else "disagree"
    return "tie" if abs(la[j] - lb[j]) <= tol else "disagree"


def compare(first: Iterable[Trajectory], second: Iterable[Trajectory], tol: float) -> dict:
    """Entry by entry over the entries both hold (one greedy trajectory each): the verdict counts, the entries
    that disagree, and how many of the common entries each scored as a success."""
    a = {t.entry_id: t for t in first}
    b = {t.entry_id: t for t in second}
    common = [e for e in a if e in b]
    verdicts = {e: verdict(a[e], b[e], tol) for e in common}
    counts = {v: sum(x == v for x in verdicts.values()) for v in ("identical", "tie", "disagree")}
    return {"entries": len(common), "tol": tol, **counts,
            "disagreeing": [e for e, v in verdicts.items() if v == "disagree"],
            "successes": [sum(bool(t[e].score["paper_reward"] == 1.0) for e in common) for t in (a, b)]}


def greedy_under(trajs: Iterable[Trajectory], token: str) -> list[Trajectory]:
    """The greedy-arm trajectories conditioned on `token` (a stage that records its arm in the provenance)."""
    return [t for t in trajs if t.provenance.get("arm") == "greedy" and t.reward_token == token]


class StagesDisagree(InputError):
    """Two stages decoded the same model greedily on the same entries under the same token and answered
    differently: one of them does not measure what it says."""


def settings(t: Trajectory) -> dict:
    """What two greedy runs must share to be compared: the output budget and the episode settings."""
    return {"max_new_tokens": (t.provenance.get("sampling") or {}).get("max_new_tokens"),
            "protocol": t.provenance.get("protocol")}


def cross_check(eval_dir: Path, trajectories: Path) -> dict:
    """`compare` an evaluate output folder's greedy answers with another stage's greedy-arm trajectories under
    the evaluation's reward token (`trajectories`, e.g. the controllability stage's), at the tolerance of the
    looser of their decoding dtypes. Raises `StagesDisagree` naming the entries when any disagree; InputError
    when the two share no entry (a check that compares nothing cannot pass) or decode with other budgets
    (answers cut at different lengths cannot be compared)."""
    token = (read_json(eval_dir / "metrics.json").get("settings") or {}).get("reward_token")
    mine = [t for t in read_trajectories(eval_dir / "trajectories.jsonl") if t.provenance.get("arm", "greedy") == "greedy"]
    theirs = greedy_under(read_trajectories(trajectories), token)
    if mine and theirs and settings(mine[0]) != settings(theirs[0]):
        raise InputError(f"{eval_dir} and {trajectories} decode with other settings ({settings(mine[0])} vs "
                         f"{settings(theirs[0])}): give both stages the same max_new_tokens and max_outputs")
    dtypes = {(t.provenance.get("backend") or {}).get("dtype") for t in mine[:1] + theirs[:1]}
    out = compare(mine, theirs, max(TOL.get(d, max(TOL.values())) for d in dtypes) if dtypes else TOL["float32"])
    out.update(evaluation=str(eval_dir), other=str(trajectories), reward_token=token)
    if not out["entries"]:
        raise InputError(f"{eval_dir} and {trajectories}: no entry decoded greedily under {token!r} in both")
    if out["disagree"]:
        raise StagesDisagree(f"{eval_dir} and {trajectories} decode the same model greedily on the same entries "
                             f"under {token!r} but disagree on {out['disagree']} of {out['entries']} entries "
                             f"(log-probs apart by more than {out['tol']}): {out['disagreeing'][:10]}; "
                             f"successes {out['successes'][0]} vs {out['successes'][1]}")
    return out
