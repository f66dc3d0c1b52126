"""controllability stage: does a reward-conditioned (RCTP) model follow its reward goal, as RL will sample it?

The premise of RC-GRPO is that the RCTP model's behaviour depends on the reward token: conditioned on
`<|high_reward|>` it should succeed more often than on `<|low_reward|>`, so that RL groups that mix tokens
have reward variance. This stage measures it on held-out entries, in one run, two ways:
- `sampled` (what RL sees): `samples_per_token` rollouts per (entry, token) at the RL sampling settings
  (`rl.temperature`, `rl.top_p`), tokens = the highest and the lowest of `label_rewards.tokens`;
- `greedy` (beside it): one rollout per (entry, token) at T = 0, plus how many entries decode to the same
  assistant messages under both tokens (the token then changes nothing);
- the sampled arm uses common random numbers: the i-th rollout of an entry draws the same row seed under
  both tokens, so the gap is paired rollout by rollout and identical pairs are counted as in greedy;
- `margin` (forward passes only, `data.margin`): the teacher-forced margin [lp(expert|high) -
  lp(expert|low)] - [lp(near miss|high) - lp(near miss|low)] per near-miss kind and overall with 95 %
  bootstrap CIs over `margin_entries` held-out entries (default: all), 0 for a model that ignores its token;
  and `token_rows`: the distance between the two reward tokens' embedding rows and its ratio to the median
  distance between two real tokens;
- `guided` (when `guidance` > 0; beyond the paper): the sampled arm with reward-token guidance of scale w,
  same seeds: does decoding-time guidance widen the gap the fine-tune left?
Per arm: success rate (paper reward R) per token, the gap E[R|high] - E[R|low] and the same for partial
credit (the shared scorer's per-turn credit; under the paper protocol, whose merged turn has no turn
boundaries, it is ~0 for model rollouts), each with a 95 % paired percentile-bootstrap CI over entries
(`evaluation.stats.paired_bootstrap_ci`: per-entry means, entries resampled).
Zero-variance mechanism: from each entry's sampled success rates p_h, p_l, the probability that a
G-sized group (G = `rl.num_generations`) has all rewards equal (no GRPO signal):
- all-high tokens (GRPO from RCTP): p_h^G + (1 - p_h)^G;
- mixed i.i.d. tokens, P(high) = q = `rl.p_high` (RC-GRPO): sum_k C(G,k) q^k (1-q)^(G-k)
  [p_h^k p_l^(G-k) + (1-p_h)^k (1-p_l)^(G-k)] (k = rollouts drawn high), which the binomial theorem
  collapses to m^G + (1 - m)^G with m = q p_h + (1 - q) p_l;
averaged over entries, with a paired bootstrap CI of mixed - all-high. Plug-in estimate: with few samples
per token the rates are often 0 or 1 and both shares are biased toward 1.

After RL (`--cell rctp-<algo>`, stages `controllability_rl_rctp@<seed>-<algo>`): the same check on an RL cell's
merged policy (`--model-dir models/rl/<seed>/rctp-<algo>`, no adapter), the same entries and row seeds as its
init's check, so q and the gap after RL sit beside the init's (does RL erode the premise?). Per arm also: each
token's failures by kind and q split by the low rollout's kind (`failure_kinds`: prose is a contrast of
format, wrong calls of content), and each entry's mean reward per token (`per_entry`, the token gap's units).

Reads: `--model-dir` + `--adapter-dir` (an sft-stage output, loaded by `HFBackend` as evaluate does),
`--entries` and `--split` (prepare_data; the `test` side, `--side dev` for design choices), params
`controllability`, `prompt`, `label_rewards.tokens` and `rl.temperature` / `rl.top_p` / `rl.num_generations` / `rl.p_high`.
Writes: `--metrics` (JSON, also to MLflow), `--trajectories` (JSONL of both arms, optional).
Run: `rcgrpo controllability --model-dir models/base --adapter-dir models/rctp/0 --entries
data/entries.jsonl --split data/split.json --metrics metrics/controllability/0.json`.
Departure from the paper: the paper reports the gap as motivation on its own model and data; the
embedded default rolls a handful of entries on CPU, so its CIs are wide.
"""

from __future__ import annotations

import math
from pathlib import Path

import typer

from rcgrpo_tasks.data.labels import load_reward_tokens
from rcgrpo_tasks.engine.compute import load_compute, resolve_compute
from rcgrpo_tasks.engine.trajectory import as_stage_output, write_trajectories
from rcgrpo_tasks.env.prompt import PromptConfig
from rcgrpo_tasks.evaluation.accuracy import RLSampling
from rcgrpo_tasks.evaluation.controllability import (
    ControllabilityConfig,
    RLGroups,
    held_out_entries,
    load_policy,
    measure,
    rl_record,
)
from rcgrpo_tasks.evaluation.formats import ci
from rcgrpo_tasks.ops import tracking, tracking_log
from rcgrpo_tasks.ops.cli import cli_errors
from rcgrpo_tasks.ops.config import as_dict, load_config, load_keys
from rcgrpo_tasks.ops.outputs import write_json


def _numbers(record: dict) -> dict:
    flat = tracking.flatten(record)
    return {k: v for k, v in flat.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)}


app = typer.Typer(add_completion=False)


@app.command()
def main(
    model_dir: Path = typer.Option(Path("models/base"), help="Base model folder (prepare_model)."),
    adapter_dir: Path | None = typer.Option(None, help="sft-stage output (e.g. models/rctp/0)."),
    entries: Path = typer.Option(Path("data/entries.jsonl"), help="Entries JSONL (prepare_data)."),
    split: Path = typer.Option(Path("data/split.json"), help="Split JSON (prepare_data)."),
    side: str | None = typer.Option(None, help="test (held out) | dev (what designs are chosen on); default: params "
                                    "controllability.side."),
    metrics: Path = typer.Option(Path("metrics/controllability/0.json"), help="Output: metrics JSON."),
    trajectories: Path | None = typer.Option(None, help="Output: the rollouts of both arms as trajectory JSONL."),
    params: Path = typer.Option(Path("params.yaml"), help="Params (sections `controllability`, `label_rewards`, `rl`)."),
    grid_seed: int | None = typer.Option(None, help="The grid seed of the measured model (params `grid.seeds`; "
                                         "MLflow tags rcgrpo.cell / rcgrpo.seed)."),
    cell: str = typer.Option("rctp", help="What is measured: `rctp` (a seed's RCTP model: the premise before RL) "
                             "or an RL cell `rctp-<algo>` (its merged policy as --model-dir: the premise after RL, "
                             "on the same entries and seeds)."),
) -> None:
    """Sampled (RL settings) and greedy E[R|high] - E[R|low] of a reward-conditioned model, with CIs."""
    with cli_errors(FileNotFoundError):
        cfg = load_config(ControllabilityConfig, params, "controllability")
        side = side or cfg.side
        prompt = load_config(PromptConfig, params, "prompt")
        tokens = load_reward_tokens(params)
        rl = load_keys(RLSampling, params, "rl")  # the sampled arm samples as RL does
        groups = load_keys(RLGroups, params, "rl")  # the zero-variance shares assume RL's groups
        picked = held_out_entries(entries, split, cfg, side=side)
        margin_set = held_out_entries(entries, split, cfg, cfg.margin_entries, side) if cfg.margin else None
        cfg.decode.check_context(model_dir, f"{params}:controllability.max_new_tokens")
        # THE dtype rule, once: the policy decodes in it, the metrics record it whole
        compute = resolve_compute(load_compute(params), decode=cfg.decode.dtype, model_dir=model_dir)
        backend = load_policy(model_dir, adapter_dir, compute.decode_dtype, (tokens[-1], tokens[0]),
                              compute.device)  # before MLflow
    stage = tracking_log.stage_name("controllability", cell, grid_seed)  # the run's name: its DVC stage's
    typer.echo(f"{stage}: decoding on {backend.describe().get('device')}")
    run_params = {"controllability": as_dict(cfg), "prompt": as_dict(prompt), "rl": rl_record(rl, groups),
                  "adapter": str(adapter_dir), "tokens": list(tokens), "side": side, "cell": cell}
    with tracking.published_run(stage, run_params, outputs=(metrics, trajectories),
                                tags=tracking_log.grid_tags(cell, grid_seed)) as (_, staged):
        result, trajs = measure(cfg, prompt, tokens, backend, picked, rl, groups,
                                {"model": str(model_dir), "adapter": str(adapter_dir)}, margin_set)
        result["grid_seed"], result["cell"] = grid_seed, cell
        result["side"], result["dtype"] = side, compute.record()
        write_json(staged.file(metrics), result)
        if trajectories:
            write_trajectories(staged.file(trajectories), as_stage_output(trajs, "controllability"))
        tracking.log_metrics(_numbers(result))
        tracking.log_dict(result, "controllability.json")
    s, z = result["sampled"], result["zero_variance"]
    arms = {arm: ci(result[arm]["gap"], result[arm]["gap_ci"]) for arm in ("greedy", "guided") if arm in result}
    greedy = f"; greedy gap {arms['greedy']}" if "greedy" in arms else ""
    greedy += f"; guided (w={cfg.guidance}) gap {arms['guided']}" if "guided" in arms else ""
    typer.echo(f"controllability over {result['n_entries']} {side} entries: sampled (T={s['temperature']}, "
               f"{s['samples_per_token']}/token) R|high {s['success_rate_high']:.3f} R|low {s['success_rate_low']:.3f} "
               f"gap {ci(s['gap'], s['gap_ci'])} ({s['identical_outputs']} of {s['pairs']} pairs identical), q "
               f"{s['premise']['q']:.3f} [{s['premise']['q_ci'][0]:.3f}, {s['premise']['q_ci'][1]:.3f}] "
               f"({s['premise']['high_only']} high-only vs {s['premise']['low_only']} low-only, exact p "
               f"{s['premise']['mcnemar_p']:.2g}){greedy}; "
               f"zero-variance share (G={z['G']}) all-high {z['all_high']:.3f} mixed {z['mixed']:.3f}; "
               f"{result['rollout_s']} s")
    gate = result["premise_gate"]
    typer.echo(f"premise gate (q >= {gate['min_q']}, sampled gap CI above 0): "
               f"{'PASSED' if gate['passed'] else 'MISSED: ' + gate['why']}")
    if "margin" in result:
        m, rows = result["margin"], result["token_rows"]
        kinds = ", ".join(f"{k} {v['margin']:+.3f}" for k, v in m["kinds"].items())
        typer.echo(f"teacher-forced margin over {m['n_entries']} {side} entries: {m['margin']:+.3f} "
                   f"[{m['ci'][0]:+.3f}, {m['ci'][1]:+.3f}] nat, {m['share_positive']:.0%} of entries > 0 ({kinds}); "
                   f"token rows {rows['distance']:.3f} apart ({rows['ratio']:.2f}x two real tokens); "
                   f"{result['margin_s']} s")


if __name__ == "__main__":
    app()
