"""label_rewards stage: reward tokens for each trajectory, and the chat datasets TRL fine-tunes on.

One definition, two datasets (`--dataset`, dvc.yaml foreach `label_rewards@sft` / `label_rewards@rctp`):
- `sft`: from `--trajectories` (`data/trajectories.jsonl`, the generate set) alone: successes only (R = 1),
  no reward token — the paper's SFT baseline. It feeds sft@sft, so it must not depend on the SFT model.
- `rctp`: the generate set plus `--policy` (`data/policy/trajectories.jsonl`: the SFT model's own rollouts
  from `sample_policy`), chosen by the pairing rule (`data.pairing`; params `failures: near_miss |
  on_policy | mixed | wrong_call`, `pairing: paired | unpaired`; `unpaired` + `near_miss` is the generate set as is),
  each row's reward token appended to the FIRST user message as `\\n\\n[Reward Goal: <token>]`
  (`rcgrpo.goal.format_goal`, the same text RL and evaluate use).
Rows `{"messages": [...], "trajectory_id", "entry_id", "reward_token", "reward"}` go to `--out`; `--metrics`
gets row / token counts, class balance and (rctp) the pairing counts. Every input trajectory file must
carry the GX gate's `passed.json` for exactly that file (`--validation`, `--policy-validation`): leakage,
unknown ids and label consistency are checked there; the 1:1 balance of the rctp set is checked here
(paired and on-policy designs are 1:1 by construction; a violation is a bug and fails the stage).

Reward tokens: `signal` (the generate_trajectories reward R, or partial credit) is binned by
`thresholds` into `tokens` (lowest first); a success (R = 1) always gets the highest token and a failure
never does (so a 3-level partial-credit design cannot put a failure under the success token).
Default binary: R=1 -> `<|high_reward|>`, R=0 -> `<|low_reward|>`. A 3-level variant: `signal:
partial_credit`, `tokens: [<|low_reward|>, <|mid_reward|>, <|high_reward|>]`, `thresholds: [0.5, 1.0]`:
failures with partial credit >= 0.5 get mid. For scripted rows under the paper protocol the partial credit
is the per-turn script's (`provenance.script_score`), since the merged protocol has a single turn; for
model rollouts under the paper protocol it is the scorer's per-turn credit of the merged turn (~0).

Loss masks: `data.chat.assistant_token_mask(tokenizer, messages) -> (input_ids, mask)` is THE mask used
for SFT and RCTP: 1 on assistant content tokens and the end-of-turn token that closes them,
0 on system/user/tool text and template scaffolding (`<|im_start|>assistant\\n`), computed from the chat
template's own rendering, so it works for any prefix-stable template (SmolLM2/Qwen ChatML included).

Run: `rcgrpo label-rewards --params params.yaml --dataset rctp --trajectories data/trajectories.jsonl
--validation data/validation --policy data/policy/trajectories.jsonl --policy-validation
data/policy/validation --model-dir models/base --out data/datasets/rctp.jsonl --metrics
metrics/label_rewards_rctp.json`
"""

from __future__ import annotations

import re
from pathlib import Path

import typer

from rcgrpo_tasks.data.dataset import GenerateConfig
from rcgrpo_tasks.data.gate import ValidationFailed
from rcgrpo_tasks.data.labels import LabelConfig, labelled
from rcgrpo_tasks.ops import tracking, tracking_log
from rcgrpo_tasks.ops.cli import GATE_EXIT, cli_errors, fail
from rcgrpo_tasks.ops.config import as_dict, load_config
from rcgrpo_tasks.ops.outputs import write_json, write_jsonl


def _flat_metrics(record: dict) -> dict:
    """Numeric metrics under MLflow-safe names (`class_balance.<|high_reward|>` -> `class_balance.high_reward`)."""
    return {re.sub(r"[^\w\-. :/]", "", k): v for k, v in tracking_log.flatten(record).items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}


app = typer.Typer(add_completion=False)


@app.command()
def main(
    params: Path = typer.Option(Path("params.yaml"), help="params file (sections `label_rewards`, `generate_trajectories`)."),
    dataset: str = typer.Option("rctp", help="sft (experts, no token) | rctp (reward-conditioned, paired)."),
    trajectories: Path = typer.Option(Path("data/trajectories.jsonl"), help="validated generate-set JSONL."),
    validation: Path = typer.Option(Path("data/validation"), help="its validate_trajectories folder."),
    policy: str = typer.Option("", help="rctp: validated on-policy samples (sample_policy); empty = none."),
    policy_validation: str = typer.Option("", help="their validation folder; empty = <policy folder>/validation."),
    model_dir: Path = typer.Option(Path("models/base"), help="model folder (tokenizer, chat template)."),
    out: Path | None = typer.Option(None, help="output dataset JSONL; default data/datasets/<dataset>.jsonl."),
    metrics: Path | None = typer.Option(None, help="output metrics JSON; default metrics/label_rewards_<dataset>.json."),
) -> None:
    """Map scores to reward tokens; write the sft or the rctp chat dataset."""
    out = out or Path(f"data/datasets/{dataset}.jsonl")
    metrics = metrics or Path(f"metrics/label_rewards_{dataset}.json")
    with cli_errors():
        cfg = load_config(LabelConfig, params, "label_rewards")
        gen = load_config(GenerateConfig, params, "generate_trajectories")
    run_params = {"label": as_dict(cfg), "reward": gen.reward, "dataset": dataset}
    with tracking.published_run("label_rewards", run_params, outputs=(out, metrics),
                                tags={"rcgrpo.dataset": dataset}) as (_, staged), cli_errors():
        try:
            rows, record = labelled(dataset, cfg, gen, trajectories, validation, model_dir, policy or None,
                                    policy_validation or None)
        except ValidationFailed as exc:
            fail(exc, GATE_EXIT)
        write_jsonl(staged.file(out), rows)
        write_json(staged.file(metrics), record)
        tracking_log.log_metrics(_flat_metrics(record))
        tracking_log.log_dict(record, f"label_rewards_{dataset}_metrics.json")
    typer.echo(f"wrote {out}: {record['n_rows']} rows {record['class_balance']}"
               + (f", {record['pairing']['prompts_used']} prompts ({cfg.failures}, {cfg.pairing})"
                  if "pairing" in record else "") + f" in {record['seconds']} s")


if __name__ == "__main__":
    app()
