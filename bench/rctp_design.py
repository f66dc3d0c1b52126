"""RCTP design levers, one at a time: does the RCTP model read its reward token, and at what cost?

Each design is the pipeline's own `sft@rctp` run (`rcgrpo sft --variant rctp`) with params overrides of the
`sft.variants.rctp` section, followed by the pipeline's own controllability check (`rcgrpo controllability`:
teacher-forced margin, greedy and paired sampled gaps at the RL temperature) on the dev entries (`--side`:
designs are chosen on dev; `test` only to re-measure a chosen one), on the
outputs `dvc repro label_rewards@rctp` left (data/datasets/rctp.jsonl, models/sft/sft). Designs run one
after another on the same inputs and seeds; each prints one JSON line: the design, RCTP's train seconds,
the margin with its CI and share of entries > 0 (overall and per near-miss kind), the token rows' distance
ratio, the greedy gap and identical pairs, the sampled gap with its CI, and the check's seconds.

Run: `python bench/rctp_design.py --design base:init=base --design sft:init=sft
--design sft_10x_pairs:init=sft,token_lr_multiplier=10,row_order=pairs [--set controllability.n_entries=16]`
(a design = NAME:key=value,... over `sft.variants.rctp`; `--set section.key=value` changes the base params;
`--data` another RCTP set, e.g. `rcgrpo label-rewards` with `label_rewards.failures: near_miss`).
Measured: docs/rl.md, "RCTP design".
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml


def _value(text: str):
    return yaml.safe_load(text)


def design_params(base: dict, overrides: dict, sets: list[str]) -> dict:
    """params.yaml with `overrides` on sft.variants.rctp and `section.key=value` sets."""
    params = json.loads(json.dumps(base))
    params["sft"]["variants"]["rctp"] = {**params["sft"]["variants"].get("rctp", {}), **overrides}
    for item in sets:
        key, value = item.split("=", 1)
        section, name = key.split(".", 1)
        params[section][name] = _value(value)
    return params


def run_design(name: str, overrides: dict, base: dict, sets: list[str], work: Path,
               data: str = "data/datasets/rctp.jsonl", side: str = "dev") -> dict:
    params = work / f"{name}.yaml"
    params.write_text(yaml.safe_dump(design_params(base, overrides, sets), sort_keys=False))
    init = "models/sft/sft" if overrides.get("init", base["sft"]["variants"]["rctp"].get("init")) == "sft" else ""
    out = work / name
    t0 = time.perf_counter()
    subprocess.run(["rcgrpo", "sft", "--params", str(params), "--variant", "rctp", "--model-dir", "models/base",
                    "--data", data, "--init-adapter", init, "--entries", "data/entries.jsonl",
                    "--split", "data/split.json", "--out", str(out / "model"), "--checkpoints", str(out / "ck"),
                    "--metrics", str(out / "sft.json")], check=True, stdout=subprocess.DEVNULL)
    train_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    subprocess.run(["rcgrpo", "controllability", "--params", str(params), "--model-dir", "models/base",
                    "--adapter-dir", str(out / "model"), "--entries", "data/entries.jsonl", "--split",
                    "data/split.json", "--side", side, "--metrics", str(out / "ctl.json")], check=True,
                   stdout=subprocess.DEVNULL)
    check_s = time.perf_counter() - t0
    m = json.loads((out / "ctl.json").read_text())
    sft = json.loads((out / "sft.json").read_text())
    mg, g, s = m["margin"], m["greedy"], m["sampled"]
    return {"design": name, "side": side, "overrides": overrides, "rctp_steps": sft["steps"], "rctp_s": round(train_s, 1),
            "margin": round(mg["margin"], 3), "margin_ci": [round(x, 3) for x in mg["ci"]],
            "margin_share_positive": round(mg["share_positive"], 2), "margin_entries": mg["n_entries"],
            "kinds": {k: round(v["margin"], 3) for k, v in mg["kinds"].items()},
            "token_rows_ratio": round(m["token_rows"]["ratio"], 3),
            "greedy_gap": g["gap"], "greedy_identical": f"{g['identical_outputs']}/{g['pairs']}",
            "greedy_high": g["success_rate_high"], "sampled_gap": round(s["gap"], 3),
            "sampled_gap_ci": [round(x, 3) for x in s["gap_ci"]], "sampled_high": round(s["success_rate_high"], 3),
            "sampled_low": round(s["success_rate_low"], 3),
            "sampled_identical": f"{s['identical_outputs']}/{s['pairs']}", "check_s": round(check_s, 1)}


def parse_design(text: str) -> tuple[str, dict]:
    name, _, body = text.partition(":")
    return name, {k: _value(v) for k, v in (kv.split("=", 1) for kv in body.split(",") if kv)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--design", action="append", required=True, help="NAME:key=value,... over sft.variants.rctp")
    ap.add_argument("--set", action="append", default=[], help="section.key=value on the base params")
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--data", default="data/datasets/rctp.jsonl", help="the RCTP set (label_rewards@rctp's by default)")
    ap.add_argument("--side", default="dev", help="controllability's entries: dev (choosing) | test (reporting)")
    ap.add_argument("--work", default=None, help="folder for the designs' outputs (default: a temp folder)")
    args = ap.parse_args()
    base = yaml.safe_load(Path(args.params).read_text())
    work = Path(args.work or tempfile.mkdtemp(prefix="rctp_design_"))
    work.mkdir(parents=True, exist_ok=True)
    for text in args.design:
        name, overrides = parse_design(text)
        print(json.dumps({**run_design(name, overrides, base, args.set, work, args.data, args.side), "data": args.data}),
              flush=True)
    print(f"outputs: {work}", file=sys.stderr)


if __name__ == "__main__":
    main()
