"""The dev sweep (sweep.run runs it, sweep.design judges it): its spec is checked before anything runs, candidates are params files the stages
load, every evaluation reads the dev side, and the design table is built from the report stage's own JSON."""

import json
import shlex
import sys
import tarfile
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from helpers import REPO_ROOT

from rcgrpo_tasks.ops import pipeline
from rcgrpo_tasks.ops.config import ConfigError
from rcgrpo_tasks.sweep import design
from rcgrpo_tasks.sweep import run as sweep


def _spec(tmp_path, body: dict):
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


@pytest.mark.parametrize("body,needle", [
    ({"cells": ["rctp-ppo"], "candidates": {"a": {}}}, "cells"),
    ({"cells": [], "candidates": {"a": {}}}, "cells"),
    ({"cells": ["rctp-grpo"], "candidates": {}}, "candidates"),
    ({"cells": ["rctp-grpo"], "candidates": {"a/b": {}}}, "folder-safe"),
    ({"cells": ["rctp-grpo"], "candidates": {"a": {}}, "extra": 1}, "unknown key"),
    ({"cells": ["rctp-grpo"], "candidates": {"init": {}}}, "sweep's own folder"),
])
def test_a_bad_spec_names_its_file_and_field(tmp_path, body, needle):
    with pytest.raises(ConfigError, match=needle):
        sweep.read_spec(_spec(tmp_path, body))


def test_the_committed_spec_loads_into_the_rl_stage_config():
    from rcgrpo_tasks.ops.config import from_dict, read_params
    from rcgrpo_tasks.train.rl.config import RLConfig

    spec = sweep.read_spec(sweep.Path("configs/sweeps/rl-dev.yaml"))
    base = read_params("params.yaml")
    for name in spec.candidates:
        params = sweep.candidate_params(base, spec, name, sweep.Path("spec.yaml"))
        from_dict(RLConfig, params["rl"], where=f"candidate {name}")
        assert params["evaluate"]["margin"] is False


def test_candidate_params_merge_common_then_own_and_refuse_unknown_sections(tmp_path):
    spec = sweep.Spec(("rctp-grpo",), {"rl": {"max_steps": 3}}, {"a": {"rl": {"learning_rate": 1.0}}, "b": {"nope": {}}})
    base = {"rl": {"max_steps": 10, "learning_rate": 0.1, "beta": 0.1}, "evaluate": {}}
    assert sweep.candidate_params(base, spec, "a", tmp_path)["rl"] == {"max_steps": 3, "learning_rate": 1.0, "beta": 0.1}
    assert base["rl"]["max_steps"] == 10
    with pytest.raises(ConfigError, match="nope"):
        sweep.candidate_params(base, spec, "b", tmp_path)


# The substitutions sweep.run documents, per stage kind: (options whose value moves into the sweep's folder,
# options dropped, arguments appended: the report's are its own `--eval`/`--rl` pairs, then `--no-track`).
# Anything else in a sweep command must be dvc.yaml's, as planned.
DOCUMENTED = {"rl": ({"--params", "--out", "--checkpoints", "--metrics", "--plots"}, set(), []),
              "evaluate": ({"--params", "--out", "--model"}, set(), ["--side", "dev"]),
              "report": ({"--params", "--table", "--json", "--plot"},
                         {"--eval-root", "--rl-root", "--controllability-root", "--agree-root", "--mechanism",
                          "--probe", "--endpoints"}, ["--no-track"]),
              "controllability": ({"--params", "--metrics", "--model-dir"}, {"--trajectories"}, ["--side", "dev"])}
KIND = {"rl_sft": "rl", "rl_rctp": "rl", "evaluate": "evaluate", "evaluate_rctp": "evaluate",
        "evaluate_rl_sft": "evaluate", "evaluate_rl_rctp": "evaluate", "report": "report",
        "controllability": "controllability", "controllability_rl_rctp": "controllability"}
"""dvc.yaml's stage definitions -> the substitution kind the sweep applies to them."""


def _pairs(argv: list[str]) -> list[tuple[str, str | None]]:
    """(option, value or None for a flag) in order."""
    out, i = [], 0
    while i < len(argv):
        takes = i + 1 < len(argv) and not argv[i + 1].startswith("--")
        out.append((argv[i], argv[i + 1] if takes else None))
        i += 2 if takes else 1
    return out


def _report_inputs(pairs, out: Path) -> tuple[list, dict[str, set[str]]]:
    """The report's appended `--eval`/`--rl` pairs split off the end: (the rest, {option: labels}); each
    path in the sweep's folder."""
    labels: dict[str, set[str]] = {"--eval": set(), "--rl": set()}
    while pairs and pairs[-1][0] in labels:
        opt, value = pairs.pop()
        label, _, path = value.partition("=")
        assert Path(path).is_relative_to(out), value
        labels[opt].add(label)
    return pairs, labels


def test_the_sweep_runs_dvc_yamls_commands_with_only_the_documented_substitutions(tmp_path):
    """Every sweep stage's command is its dvc.yaml stage's (as DVC resolves it: the plan of `rcgrpo plan`)
    with only the documented options moved into the sweep's folder, dropped or appended: an option added to
    dvc.yaml reaches the sweep, and a sweep cannot train, score or tabulate otherwise than the pipeline."""
    planned = {s.name: s for s in pipeline.dvc_stages(REPO_ROOT, with_status=False)}
    cells = tuple(f"{n.partition('@')[0][3:]}-{n.partition('-')[2]}" for n in planned
                  if n.startswith("rl_") and n.partition("@")[2].startswith("0-"))
    inits = sorted({c.partition("-")[0] for c in cells})
    spec = sweep.Spec(cells, {}, {"a": {}, "b": {}}, premise=True)
    out = tmp_path / "sw"
    plan = sweep.sweep_plan(list(planned.values()), spec, ["a", "b"], out)
    rctp = [c for c in cells if c.startswith("rctp-")]
    assert cells and rctp and sorted(s.name for s in plan) == sorted(
        [f"init/evaluate@{i}" for i in inits] + ["a/report", "b/report", "init/controllability@rctp"]
        + [f"{n}/{k}@{c}" for n in "ab" for c in cells for k in ("rl", "evaluate")]
        + [f"{n}/controllability@{c}" for n in "ab" for c in rctp])
    base_of = {f"init/evaluate@{i}": spec.init_stage(i) for i in inits} | {"report": "report"}
    base_of |= {f"{k}@{c}": spec.stages(c)[k == "evaluate"] for c in cells for k in ("rl", "evaluate")}
    base_of |= {"init/controllability@rctp": "controllability@0"}
    base_of |= {f"controllability@{c}": f"controllability_rl_rctp@0-{c.partition('-')[2]}" for c in rctp}
    for stage in plan:
        base = planned[base_of.get(stage.name) or base_of[stage.name.partition("/")[2]]]
        moved, dropped, add = DOCUMENTED[KIND[base.name.partition("@")[0]]]
        mine, theirs = shlex.split(stage.cmds[0]), shlex.split(base.cmds[0])
        assert mine[:2] == theirs[:2] and mine[len(mine) - len(add):] == add, stage.name
        pairs = _pairs(mine[2:len(mine) - len(add)])
        if base.name == "report":
            pairs, labels = _report_inputs(pairs, out)
            assert labels == {"--eval": {*inits, *cells}, "--rl": set(cells)}
        kept = [(o, v) for o, v in _pairs(theirs[2:]) if o not in dropped]
        if stage.name == "init/controllability@rctp":  # the init's check keeps its adapter: only the cells' move
            moved = moved - {"--model-dir"}
        assert [(o, "*" if o in moved else v) for o, v in pairs] == [(o, "*" if o in moved else v) for o, v in kept]
        for opt, value in pairs:
            if opt in moved and (opt, value) not in kept:
                assert Path(value).is_relative_to(out), (stage.name, opt, value)
        assert all(Path(p).is_relative_to(out) for p in (*stage.outs, *stage.records)), stage.name


def test_an_input_the_sweep_does_not_make_fails_the_plan_naming_it(tmp_path):
    """A new option of dvc.yaml's report naming a pipeline result the sweep neither runs nor moves (here the
    controllability stage's) stops the sweep before it starts, instead of reading the pipeline's file."""
    planned = pipeline.dvc_stages(REPO_ROOT, with_status=False)
    planned = [replace(s, cmds=(s.cmds[0] + " --extra rctp=metrics/controllability/0.json",)) if s.name == "report"
               else s for s in planned]
    spec = sweep.Spec(("rctp-grpo",), {}, {"a": {}})
    with pytest.raises(ConfigError, match="a/report.*controllability"):
        sweep.sweep_plan(planned, spec, ["a"], tmp_path / "sw")
    with pytest.raises(ConfigError, match="no stage rl_rctp@0-ppo"):
        sweep.sweep_plan(planned, sweep.Spec(("rctp-ppo",), {}, {"a": {}}), ["a"], tmp_path / "sw")


def test_the_design_table_reads_each_candidate_s_report(tmp_path):
    spec = sweep.Spec(("rctp-grpo", "rctp-rc_grpo"), {}, {"a": {}, "b": {"rl": {"learning_rate": 1.0}}})
    row = {"overall": {"accuracy": 25.0}, "n": 60, "vs_init": {"diff": 5.0, "ci": [1.7, 8.3]},
           "rl_probe": {"change": {"mean": 0.25, "ci_low": 0.1, "ci_high": 0.4}}}
    zero = {"groups": 40, "both": 10, "only_grpo": 9, "only_cell": 1, "grpo": 0.475, "cell": 0.275,
            "mcnemar_p": 0.021}
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "report.json").write_text(json.dumps(
        {"rows": {"rctp-grpo": row, "rctp-rc_grpo": row},
         "rc_grpo_vs_grpo": {"rctp-rc_grpo": {"versus": "rctp-grpo", "zero_std_paired": zero}}}))
    (tmp_path / "timings.json").write_text(json.dumps({"a/rctp-grpo": {"status": "ok", "seconds": 12.0},
                                                       "b/rctp-grpo": {"status": "failed (exit 2)", "seconds": 3.0}}))
    rows = design.design_rows(tmp_path, spec)
    assert [(r["candidate"], r["cell"]) for r in rows] == [("a", "rctp-grpo"), ("a", "rctp-rc_grpo"),
                                                           ("b", "rctp-grpo"), ("b", "rctp-rc_grpo")]
    assert rows[1]["rc_grpo_vs_grpo_zero_std"] == zero and rows[0]["rc_grpo_vs_grpo_zero_std"] is None
    md = design.design_markdown(rows)
    assert "| a | rctp-grpo | 25.0 (n=60) | +5.0 [+1.7, +8.3] | +0.250 [+0.100, +0.400] |  | n/a | n/a | 12 | ok |" in md
    assert "0.28 vs 0.47 over 40 groups (1 vs 9, p = 0.021)" in md
    assert "| b | rctp-grpo | n/a | n/a | n/a |  | n/a | n/a | 3 | failed (exit 2) |" in md
    assert "| b | rctp-rc_grpo | n/a | n/a | n/a |  | n/a | n/a | n/a | not run |" in md


def _eval(folder, correct: dict):
    folder.mkdir(parents=True)
    (folder / "results.jsonl").write_text("".join(
        json.dumps({"id": i, "valid": bool(v), "category": "simple_python", "task": "single_turn"}) + "\n"
        for i, v in correct.items()))
    (folder / "metrics.json").write_text(json.dumps({"settings": {"side": "dev"}}))


def test_replicates_pool_per_entry_and_compare_paired_with_the_init_and_the_default(tmp_path):
    """Two runs of one spec: a candidate's dev entries are averaged over cells x runs, then compared with the
    init and the default entry by entry; the spread says how far the runs are apart."""
    ids = [f"simple_python_{i}" for i in range(10)]
    spec = sweep.Spec(("rctp-grpo", "rctp-rc_grpo"), {}, {"default": {}, "other": {}})
    for run, default_right in (("A", 4), ("B", 2)):
        _eval(tmp_path / run / "init" / "rctp", {i: k < 5 for k, i in enumerate(ids)})
        for cell in spec.cells:
            _eval(tmp_path / run / "default" / cell / "eval", {i: k < default_right for k, i in enumerate(ids)})
            _eval(tmp_path / run / "other" / cell / "eval", {i: k < 5 for k, i in enumerate(ids)})
    rows = {r["candidate"]: r for r in design.pooled_rows([tmp_path / "A", tmp_path / "B"], spec)}
    assert "spread over cell runs" in design.pooled_markdown(list(rows.values()), "default")
    assert rows["default"]["runs"] == 4 and rows["default"]["dev_accuracy"] == pytest.approx(30.0)
    assert rows["default"]["spread"] == pytest.approx(20.0) and "vs_baseline" not in rows["default"]
    assert rows["default"]["vs_init"]["diff"] == pytest.approx(-20.0) and rows["default"]["vs_init"]["n"] == 10
    assert rows["other"]["vs_init"]["diff"] == pytest.approx(0.0) and rows["other"]["spread"] == 0.0
    assert rows["other"]["vs_baseline"]["diff"] == pytest.approx(20.0)
    lo, hi = rows["other"]["vs_baseline"]["ci"]
    assert 0.0 <= lo < 20.0 < hi
    md = design.pooled_markdown(list(rows.values()), "default")
    assert "| other | 4 | 50.0 | 0.0 | +0.0 [no spread: no interval] | +20.0 [" in md


def _ctl(path, q: float, gap: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"sampled": {"gap": gap, "gap_ci": [gap - 0.1, gap + 0.1],
                                            "premise": {"q": q, "q_ci": [q - 0.1, q + 0.1]}}}))


def test_an_ablation_is_chosen_per_cell_on_the_premise_after_rl_over_seeds(tmp_path):
    """Replicates on seeds 0 and 1 (`--seed`): per cell, dev accuracy, q before and after RL on dev, and the
    pool's token gap in the first vs the last third of training, each a mean over runs beside the runs."""
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text("cells: [rctp-rc_grpo, rctp-rc_frozen]\npremise: true\ncandidates: {default: {}}\n")
    spec = sweep.read_spec(spec_file, seed=1)
    assert spec.seed == 1 and spec.premise and sweep.read_spec(spec_file).seed == 0
    for run, (erode, keep) in (("s0", (0.1, 0.5)), ("s1", (0.2, 0.4))):
        root = tmp_path / run
        _ctl(root / "init" / "ctl-rctp.json", 0.7, 0.2)
        for cell, q in (("rctp-rc_grpo", erode), ("rctp-rc_frozen", keep)):
            _ctl(root / "default" / cell / "ctl.json", q, 0.05)
            rows = [{"step": s, "controllability_gap": 0.3 - (0.25 if cell == "rctp-rc_grpo" else 0.05) * (s > 4)}
                    for s in range(1, 7)]
            (root / "default" / cell).mkdir(parents=True, exist_ok=True)
            (root / "default" / cell / "rl.tsv").write_text(
                "step\tcontrollability_gap\n" + "".join(f"{r['step']}\t{r['controllability_gap']}\n" for r in rows))
        (root / "default" / "report.json").write_text(json.dumps(
            {"rows": {c: {"overall": {"accuracy": 30.0 + i}} for i, c in enumerate(spec.cells)}}))
    rows = {r["cell"]: r for r in design.pooled_cells([tmp_path / "s0", tmp_path / "s1"], spec)}
    assert rows["rctp-rc_grpo"]["q_after"] == pytest.approx(0.15) and rows["rctp-rc_frozen"]["q_after"] == pytest.approx(0.45)
    assert rows["rctp-rc_grpo"]["q_before"] == pytest.approx(0.7) and rows["rctp-rc_frozen"]["dev_accuracy"] == 31.0
    assert rows["rctp-rc_grpo"]["gap_first"] == pytest.approx(0.3) and rows["rctp-rc_grpo"]["gap_last"] == pytest.approx(0.05)
    md = design.cells_markdown(list(rows.values()))
    assert "| default | rctp-rc_frozen | 2 | 31.0 (31.0, 31.0) | 0.70 (0.70, 0.70) | 0.45 (0.50, 0.40) |" in md
    row = design.design_rows(tmp_path / "s0", spec)[1]
    assert row["premise_after"]["q"] == 0.5 and row["gap_thirds"] == pytest.approx([0.3, 0.3, 0.25])
    assert "0.50 [0.40, 0.60], gap +0.05 [-0.05, +0.15] (0.70 [0.60, 0.80], gap +0.20" in design.design_markdown([row])


def test_a_candidate_with_an_unknown_section_fails_before_anything_is_written(tmp_path):
    spec = _spec(tmp_path, {"cells": ["rctp-grpo"], "candidates": {"good": {"rl": {"max_steps": 1}},
                                                                     "bad": {"nope": {}}}})
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"rl": {"max_steps": 10}, "label_rewards": {"tokens": ["<|l|>", "<|h|>"]}}))
    with pytest.raises(ConfigError, match="candidates.bad"):
        sweep.run_sweep(spec, tmp_path / "out", params, [], root=tmp_path)
    assert not (tmp_path / "out").exists()


FAKE_STAGE = """
import json, sys
from pathlib import Path
kind, args, opts = sys.argv[1], sys.argv[2:], {}
for i, a in enumerate(args):
    if a.startswith("--"):
        opts.setdefault(a, []).append(args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else "")
if "--params" in opts and "fail: true" in Path(opts["--params"][0]).read_text():
    sys.exit(3)
def write(path, text):
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text)
if kind == "rl":
    write(opts["--out"][0] + "/weights.bin", "w")
    write(opts["--metrics"][0], "{}")
    write(opts["--plots"][0], "step\\n")
elif kind == "evaluate":
    assert opts["--side"] == ["dev"] and Path(opts["--model"][0]).exists()
    write(opts["--out"][0] + "/results.jsonl", json.dumps({"model": opts["--model"][0]}) + "\\n")
else:
    assert all(Path(v.partition("=")[2]).exists() for v in opts["--eval"] + opts["--rl"])
    write(opts["--json"][0], json.dumps({"rows": {v.partition("=")[0]: {} for v in opts["--eval"]}}))
    write(opts["--table"][0], "t")
"""


def _fake_pipeline(root: Path) -> list[pipeline.PlannedStage]:
    """The sweep's part of a pipeline, each stage one `python fake.py <kind> ...` argv with dvc.yaml's options."""
    (root / "fake.py").write_text(FAKE_STAGE)
    run = f"{shlex.quote(sys.executable)} fake.py"

    def stage(name, args, outs=(), records=(), upstream=()):
        return pipeline.PlannedStage(name, (f"{run} {args}",), tuple(upstream), tuple(outs), tuple(records))

    return [stage("rctp@0", "sft --params params.yaml --out models/rctp/0", ["models/rctp/0"]),
            stage("rl_rctp@0-grpo", "rl --params params.yaml --adapter-dir models/rctp/0 --out models/rl/0/rctp-grpo "
                  "--checkpoints checkpoints/rl/0/rctp-grpo --metrics results/rl/0/rctp-grpo/metrics.json --plots "
                  "results/rl/0/rctp-grpo/steps.tsv", ["models/rl/0/rctp-grpo"],
                  ["results/rl/0/rctp-grpo/metrics.json", "results/rl/0/rctp-grpo/steps.tsv"], ["rctp@0"]),
            stage("evaluate_rctp@0", "evaluate --params params.yaml --model models/rctp/0 --out results/eval/0/rctp",
                  ["results/eval/0/rctp/results.jsonl"], upstream=["rctp@0"]),
            stage("evaluate_rl_rctp@0-grpo", "evaluate --params params.yaml --model models/rl/0/rctp-grpo --out "
                  "results/eval/0/rctp-grpo", ["results/eval/0/rctp-grpo/results.jsonl"], upstream=["rl_rctp@0-grpo"]),
            stage("controllability@0", "controllability --out metrics/c/0.json", records=["metrics/c/0.json"]),
            stage("report", "report --params params.yaml --eval-root results/eval --rl-root results/rl "
                  "--controllability-root metrics/c --table results/t.md --json results/report.json --plot "
                  "results/a.png --mechanism results/m.png", [],
                  ["results/t.md", "results/report.json", "results/a.png", "results/m.png"],
                  ["evaluate_rctp@0", "evaluate_rl_rctp@0-grpo", "controllability@0"])]


def test_the_plan_runner_runs_the_sweep_and_a_failed_candidate_stops_only_itself(tmp_path):
    """run_sweep on stand-in stage commands, two side by side: each candidate's rl -> evaluate on dev ->
    report in its own folder, the init once, one candidate's failure recorded without stopping the other;
    the pipeline's own output paths untouched; one bundle (results, logs, params, plan; no model)."""
    planned = _fake_pipeline(tmp_path)
    spec = _spec(tmp_path, {"cells": ["rctp-grpo"], "candidates": {"good": {}, "bad": {"rl": {"fail": True}}}})
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"rl": {"fail": False}}))
    out = tmp_path / "sw"
    with pytest.raises(ConfigError, match=r"models/rctp/0.*dvc repro rctp@0"):  # the init it starts from
        sweep.run_sweep(spec, out, params, planned, root=tmp_path)
    assert not out.exists()
    (tmp_path / "models" / "rctp" / "0").mkdir(parents=True)
    run = sweep.run_sweep(spec, out, params, planned, jobs=2, bundle=tmp_path / "b.tar.gz", root=tmp_path)
    assert {k: v["status"] for k, v in json.loads((out / "timings.json").read_text()).items()} == {
        "init/rctp": "ok", "good/rctp-grpo": "ok", "good/report": "ok", "bad/rctp-grpo": "failed (exit 3)",
        "bad/report": "not run"}
    assert {r["candidate"]: r["status"] for r in design.design_rows(out, run.spec)} == {"good": "ok",
                                                                                      "bad": "failed (exit 3)"}
    assert set(json.loads((out / "good" / "report.json").read_text())["rows"]) == {"rctp", "rctp-grpo"}
    assert json.loads((out / "good" / "rctp-grpo" / "eval" / "results.jsonl").read_text())["model"] == str(
        out / "good" / "rctp-grpo" / "model")
    assert [p.name for p in (tmp_path / "models").iterdir()] == ["rctp"]
    assert not any((tmp_path / p).exists() for p in ("results", "metrics", "checkpoints"))
    with tarfile.open(sweep.write_sweep_bundle(run, tmp_path / "b.tar.gz")) as tar:
        names = set(tar.getnames())
    assert {"sw/good/report.json", "sw/good/rctp-grpo/eval/results.jsonl", "sw/good/rctp-grpo/rl.json",
            "sw/logs/good/rl@rctp-grpo.log", "sw/logs/bad/rl@rctp-grpo.log", "sw/plan.json", "sw/timings.json",
            "sw/good/params.yaml", "sw/init/params.yaml", "timings.json"} <= names
    assert not any("/model/" in n for n in names)


def test_the_ablation_sweep_plans_under_its_profile(tmp_path):
    """configs/sweeps/ablation-dev.yaml under `study-pool+ablation-dev`, as the lead runs it: every cell's rl,
    dev evaluation and check after RL, the init's check, on grid seed 2 (`--seed`)."""
    import shutil

    from dvc.repo import Repo

    from rcgrpo_tasks.ops.profiles import resolve_profile

    root = tmp_path / "repo"
    root.mkdir()
    Repo.init(str(root), no_scm=True)
    shutil.copy(REPO_ROOT / "dvc.yaml", root / "dvc.yaml")
    params = resolve_profile("study-pool+ablation-dev", REPO_ROOT).merged
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    spec = sweep.read_spec(REPO_ROOT / "configs" / "sweeps" / "ablation-dev.yaml", seed=2)
    assert spec.premise and spec.cells == ("rctp-rc_grpo", "rctp-rc_frozen", "rctp-rc_lowmask")
    plan = sweep.sweep_plan(pipeline.dvc_stages(root, with_status=False), spec, ["default"], tmp_path / "sw")
    names = {s.name for s in plan}
    assert {f"default/{k}@{c}" for c in spec.cells for k in ("rl", "evaluate", "controllability")} <= names
    assert "init/controllability@rctp" in names and "init/evaluate@rctp" in names
    ctl = next(s for s in plan if s.name == "default/controllability@rctp-rc_frozen")
    assert "controllability_rl_rctp" not in ctl.cmds[0] and "--grid-seed 2" in ctl.cmds[0] and ctl.cmds[0].endswith("--side dev")
