"""The report over seeds: RCTP's premise gate first, the declared endpoints with their exact tests (checked
against the counts the synthetic grid was built with), the rows pooled over seeds, learning on the pool, each
seed's tables, and a grid or endpoint that names what was not run failing with a clear message."""

from __future__ import annotations

import json

import pytest
import yaml
from typer.testing import CliRunner

from rcgrpo.stats import mcnemar_exact
from rcgrpo_tasks.ops.outputs import write_json, write_jsonl
from rcgrpo_tasks.stages import report as report_stage

N = 20
CELLS = ("rctp-grpo", "rctp-rc_grpo")
NO_RULE = {"decisive": "unit", "sesoi": {}, "decisions": {}, "premise_kept_q": None}
"""The decision-rule keys of params `endpoints`, none declared."""


def _results(folder, correct: list[int], pass1: list[float], side: str = "test") -> None:
    write_jsonl(folder / "results.jsonl", [
        {"id": f"simple_python_{i}", "category": "simple_python", "valid": bool(c), "official_valid": bool(c),
         "partial_credit": float(c), "paper_reward": float(c), "pass1": p} for i, (c, p) in enumerate(zip(correct, pass1))])
    write_json(folder / "metrics.json", {"settings": {"side": side}})


def _steps(path, steps: int = 2) -> None:
    """Steps whose token gap shrinks: reward_high 0.6, reward_low 0.1 -> 0.4 over the run."""
    path.parent.mkdir(parents=True, exist_ok=True)
    cols = ["step", "reward", "frac_zero_std", "adv_abs_mean", "adv_std", "controllability_gap", "reward_high",
            "reward_low"]
    rows = [(s, 0.5, 0.4, 0.3, 0.4, 0.6 - low, 0.6, low) for s in range(1, steps + 1)
            for low in [0.1 + 0.3 * (s - 1) / max(steps - 1, 1)]]
    path.write_text("\t".join(cols) + "\n" + "".join("\t".join(map(str, r)) + "\n" for r in rows))


def _groups(flat_grpo: int, flat_rc: int, n: int = 30) -> tuple[list[dict], list[dict]]:
    """n paired groups: GRPO's first `flat_grpo` flat, RC-GRPO's first `flat_rc`."""
    def run(k):
        return [{"step": g // 4, "group": g % 4, "entry_id": f"e{g}", "flat": "success" if g < k else None,
                 "nonzero_adv": {"high": 0 if g < k else 2}} for g in range(n)]
    return run(flat_grpo), run(flat_rc)


def _probe(up: int, down: int) -> dict:
    change = {"mean": (up - down) / 12, "ci_low": -0.1, "ci_high": 0.2, "prompts": 12, "up": up, "down": down,
              "sign_p": mcnemar_exact(up, down)}
    return {"entries": ["a"], "samples": 2, "steps": [0, 2], "reward": [0.4, 0.5], "change": change,
            "per_entry": {}, "transfer": {"entries": ["b"], "change": {**change, "up": down, "down": up}, "reward": [0.4, 0.4],
                                          "per_entry": {}}}


def _grid(tmp_path, seeds=(0, 1), gate_q=(0.45, 0.2), side="test"):
    """A two-seed grid's outputs: GRPO flat in 12 of 30 paired groups, RC-GRPO in 4 (every seed); RC-GRPO's
    pass@1 +0.25 on the first 8 entries; pool learning 7 up / 1 down per cell and seed."""
    root = tmp_path / "out"
    params = {"grid": {"seeds": list(seeds), "rl": {"sft": [], "rctp": list(a.split("-")[1] for a in CELLS)},
                       "evaluate": {"sft": {"model": "m", "adapter": "a", "dep": "a", "reward_token": "", "flags": ""}}},
              "endpoints": {"alpha": 0.05, "power": 0.8, **NO_RULE,
                            "primary": [{"measure": "zero_variance", "cell": "rctp-rc_grpo", "versus": "rctp-grpo"},
                                        {"measure": "pass1", "cell": "rctp-rc_grpo", "versus": "rctp-grpo"}],
                            "secondary": [{"measure": "greedy", "cell": "rctp-rc_grpo", "versus": "rctp-grpo"},
                                          {"measure": "pool_learning", "cell": "rctp-grpo"},
                                          {"measure": "transfer", "cell": "rctp-rc_grpo"}]}}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    base = [i % 2 for i in range(N)]
    _results(root / "eval" / "sft", base, [0.25] * N, side)
    for s, q in zip(seeds, gate_q):
        _results(root / "eval" / str(s) / "rctp", base, [0.25] * N, side)
        _results(root / "eval" / str(s) / "rctp-grpo", base, [0.25] * N, side)
        _results(root / "eval" / str(s) / "rctp-rc_grpo", [1 if i < 3 else c for i, c in enumerate(base)],
                 [0.5 if i < 8 else 0.25 for i in range(N)], side)
        grpo, rc = _groups(12, 4)
        for cell, groups in zip(CELLS, (grpo, rc)):
            learn = {"prompts": 10, "up": 7, "down": 1, "ties": 2, "sign_p": mcnemar_exact(7, 1)}
            metrics = {"groups": groups, "pool": {"ids": ["a"], "size": 17, "step0_success": 0.5},
                       "pool_learning": learn, "pool_learning_equal": {**learn, "up": 6, "per_visit": 2},
                       "probe": _probe(5, 1), "steps": 2,
                       "nonzero_adv": {"high": sum(g["nonzero_adv"]["high"] for g in groups)},
                       "failures": {"high": {"rollouts": 40, "success": 20, "unscored": 0, "no_call": 2,
                                             "wrong_function": 8, "wrong_arguments": 10}}}
            write_json(root / "rl" / str(s) / cell / "metrics.json", metrics)
            _steps(root / "rl" / str(s) / cell / "steps.tsv")
            write_json(root / "ctl" / str(s) / f"{cell}.json", _check(q - 0.15, 0.05, side))
        write_json(root / "ctl" / f"{s}.json", _check(q, 0.1, side))
    return tmp_path / "params.yaml", root


def _check(q: float, gap: float, side: str) -> dict:
    """A controllability check: q, and every entry's gap `gap` (high 0.3, low 0.3 - gap)."""
    return {"side": side, "premise_gate": {"min_q": 0.3, "q": q, "gap_ci_low": 0.01, "passed": q >= 0.3,
                                           "why": "met" if q >= 0.3 else f"q {q:.3f} < 0.3"},
            "sampled": {"gap": gap, "gap_ci": [gap - 0.09, gap + 0.1], "success_rate_high": 0.3,
                        "success_rate_low": 0.3 - gap, "premise": {"q": q, "q_ci": [q - 0.1, q + 0.1]},
                        "q_by_kind": {"no_call": q, "wrong_function": 0.0, "wrong_arguments": 0.0},
                        "per_entry": {f"simple_python_{i}": [0.3, 0.3 - gap] for i in range(N)}}}


def _run(params, root, *extra, track: bool = False):
    args = ["--params", str(params), "--eval-root", str(root / "eval"), "--rl-root", str(root / "rl"),
            "--controllability-root", str(root / "ctl"), "--table", str(root / "t.md"),
            "--json", str(root / "r.json"), "--plot", str(root / "a.png"), *extra, *([] if track else ["--no-track"])]
    return CliRunner().invoke(report_stage.app, args)


def test_the_report_leads_with_the_premise_and_the_declared_endpoints(tmp_path):
    params, root = _grid(tmp_path)
    res = _run(params, root, "--probe", str(root / "p.png"), "--mechanism", str(root / "m.png"))
    assert res.exit_code == 0, res.output
    md = (root / "t.md").read_text()
    assert md.index("premise gate MISSED in 1 of 2 seeds") < md.index("## Endpoints") < md.index("## Outcome pooled")
    assert "seed 1: q 0.200 < 0.3" in md and "5 comparisons reported (2 primary, 3 secondary)" in md
    data = json.loads((root / "r.json").read_text())
    ends = {e["name"]: e for e in data["endpoints"]}
    zero = ends["zero_variance: rctp-rc_grpo vs rctp-grpo"]  # 8 groups flat under GRPO only, per seed
    assert (zero["only_first"], zero["only_second"], zero["n"]) == (0, 16, 60)
    assert zero["p"] == pytest.approx(mcnemar_exact(0, 16)) and zero["ci"][1] < 0 < zero["mde"]
    assert zero["cell_share"] == pytest.approx(4 / 30) and zero["versus_share"] == pytest.approx(12 / 30)
    pass1 = ends["pass1: rctp-rc_grpo vs rctp-grpo"]
    assert pass1["diff"] == pytest.approx(0.25 * 8 / N) and pass1["n"] == N and pass1["p"] < 0.05
    greedy = ends["greedy: rctp-rc_grpo vs rctp-grpo"]
    assert (greedy["only_first"], greedy["only_second"]) == (4, 0)  # entries 0 and 2 of each seed
    learn = ends["pool_learning: rctp-grpo"]  # on equal samples per visit
    assert (learn["up"], learn["down"]) == (12, 2) and learn["p"] == pytest.approx(mcnemar_exact(12, 2))
    assert (ends["transfer: rctp-rc_grpo"]["up"], ends["transfer: rctp-rc_grpo"]["down"]) == (2, 10)
    pooled = {r["label"]: r for r in data["pooled"]}
    assert pooled["rctp-rc_grpo"]["pass1"]["mean"] == pytest.approx(100 * (0.25 + 0.25 * 8 / N))
    assert pooled["rctp-rc_grpo"]["vs"]["init"] == "rctp" and pooled["rctp"]["vs"]["init"] == "sft"
    assert "## Seed 0" in md and "## Seed 1" in md and "| 1 | RCTP+RC-GRPO | 17, 0.500 | 6 / 1 of 10" in md
    assert set(data["seeds"]) == {"0", "1"} and "rctp-rc_grpo" in data["seeds"]["1"]["rows"]
    assert all((root / f).stat().st_size > 1000 for f in ("a.png", "p.png", "m.png"))
    beside = md[md.index("## The paper beside"):]  # pooled greedy: 12 / 20 and 10 / 20 correct in each seed
    assert "| RCTP+RC-GRPO | 85.00 | 60.0 |" in beside and "| RCTP+GRPO | 73.75 | 50.0 |" in beside
    assert "| Base | 11.25 | not run |" in beside
    assert "the paper +11.25 points; this run pass1 +10.0 [" in beside and "; greedy +10.0 [" in beside
    assert "+15.9] (the interval includes the paper's +11.25)" in beside  # pass1 +10.0 [+4.1, +15.9]


def test_a_run_whose_seeds_all_pass_the_gate_says_so_and_its_run_is_tracked(tmp_path, store):
    """Tracked: every seeded row's metrics reach MLflow under names it accepts (`rctp@1` has no `@` there)."""
    import mlflow

    params, root = _grid(tmp_path, gate_q=(0.45, 0.35))
    res = _run(params, root, track=True)
    assert res.exit_code == 0, res.output
    assert "premise gate passed in all 2 seeds" in (root / "t.md").read_text()
    (run,) = mlflow.search_runs(search_all_experiments=True, output_format="list")
    assert run.data.metrics["rctp-rc_grpo/seed1/overall_acc"] == pytest.approx(60.0)


@pytest.mark.parametrize("side,name", [("dev", "dev"), ("test", "held-out")])
def test_a_grid_report_names_its_split_and_a_mix_of_sides_is_refused(tmp_path, monkeypatch, side, name):
    """A report names the split its evaluations and checks read (their `settings.side` / `side`) in its notes,
    headings and plot titles (on dev, nothing says held-out); one evaluation of another side fails the stage
    naming both sides and who read each, and writes nothing."""
    titles = []
    for plot in ("accuracy_plot", "probe_plot"):
        real = getattr(report_stage, plot)
        monkeypatch.setattr(report_stage, plot, lambda *a, _real=real, **k: (titles.append(a[3]), _real(*a, **k)))
    params, root = _grid(tmp_path, side=side)
    res = _run(params, root, "--probe", str(root / "p.png"))
    assert res.exit_code == 0, res.output
    text = (root / "t.md").read_text() + (root / "r.json").read_text() + "".join(titles) + res.output
    assert ("held-out" in text) == (side == "test") and "held out" not in text
    assert f"on the {name} entries" in text and f"## Outcome pooled over seeds ({name} entries)" in text
    assert json.loads((root / "r.json").read_text())["side"] == side
    assert titles[0] == f"BFCL v4 single_turn, {name} split" and len(titles) == 2
    other = "test" if side == "dev" else "dev"
    _results(root / "eval" / "1" / "rctp", [0] * N, [0.25] * N, other)
    (root / "t.md").unlink()
    res = _run(params, root)
    assert res.exit_code == 2 and not (root / "t.md").exists()
    assert f"{side} (sft, rctp@0, rctp-grpo@0" in res.output and f"{other} (rctp@1)" in res.output, res.output


def test_a_missing_seed_or_an_endpoint_on_an_unrun_cell_fails_clearly_and_writes_nothing(tmp_path):
    params, root = _grid(tmp_path)
    p = yaml.safe_load(params.read_text())
    p["grid"]["seeds"] = [0, 1, 2]
    params.write_text(yaml.safe_dump(p))
    res = _run(params, root)
    assert res.exit_code == 2 and "seed 2" in res.output and not (root / "t.md").exists()
    p["grid"]["seeds"] = [0, 1]
    p["endpoints"]["secondary"].append({"measure": "pass1", "cell": "sft-grpo", "versus": "sft"})
    params.write_text(yaml.safe_dump(p))
    res = _run(params, root)
    assert res.exit_code == 2 and "sft-grpo" in res.output and not (root / "t.md").exists()


PASS1 = {"measure": "pass1", "cell": "a", "versus": "b"}
DECISIONS = {"gain": "g", "no_gain": "n", "inconclusive": "i"}


@pytest.mark.parametrize("endpoints,needle", [
    ({"alpha": 0.05, "power": 0.8, "primary": [], "secondary": []}, "primary"),
    ({"alpha": 0.05, "power": 0.8, "primary": [{"measure": "pass1", "cell": "a"}], "secondary": []}, "versus"),
    ({"alpha": 0.05, "power": 0.8, "primary": [{"measure": "accuracy", "cell": "a", "versus": "b"}],
      "secondary": []}, "measure"),
    ({"alpha": 0.7, "power": 0.8, "primary": [{"measure": "probe", "cell": "a"}], "secondary": []}, "alpha"),
    ({"alpha": 0.05, "power": 0.8, "primary": [PASS1], "secondary": [], "decisions": DECISIONS}, "sesoi for every"),
    ({"alpha": 0.05, "power": 0.8, "primary": [PASS1], "secondary": [], "sesoi": {"pass1": 0.02},
      "decisions": {"gain": "g"}}, "one text for each outcome"),
    ({"alpha": 0.05, "power": 0.8, "primary": [PASS1], "secondary": [], "sesoi": {"pass1": -0.02}}, "sesoi"),
    ({"alpha": 0.05, "power": 0.8, "primary": [PASS1], "secondary": [], "decisive": "both"}, "decisive"),
    ({"alpha": 0.05, "power": 0.8, "primary": [PASS1], "secondary": [], "premise_kept_q": 1.5}, "premise_kept_q"),
    ({"alpha": 0.05, "power": 0.8, "primary": [PASS1], "secondary": [], "decisions": {}}, "missing key"),
])
def test_malformed_endpoints_fail_naming_the_field(endpoints, needle):
    from rcgrpo_tasks.evaluation.endpoints import EndpointsConfig
    from rcgrpo_tasks.ops.config import ConfigError, from_dict

    if needle != "missing key":
        endpoints = {**NO_RULE, **endpoints}
    with pytest.raises(ConfigError, match=needle):
        from_dict(EndpointsConfig, endpoints, "params.yaml:endpoints")


def test_the_declared_rule_decides_each_primary_endpoint_and_recomputes(tmp_path):
    """A declared rule (SESOI, decisive level, decisions) is printed as a table with the outcome each primary
    endpoint reached, from its decisive interval; q after RL per cell with the premise's threshold; the table
    recomputes from the endpoint files alone, rule included."""
    from rcgrpo_tasks.evaluation.endpoints import outcome
    from rcgrpo_tasks.stages import endpoints as endpoints_stage

    params, root = _grid(tmp_path, gate_q=(0.6, 0.7))
    p = yaml.safe_load(params.read_text())
    p["endpoints"].update(sesoi={"pass1": 0.025, "zero_variance": 0.05}, decisions={
        "gain": "{cell} gains over {versus}", "no_gain": "no gain of {cell}", "inconclusive": "more seeds"},
        premise_kept_q=0.5)
    p["endpoints"]["secondary"] += [{"measure": "q_after", "cell": "rctp-rc_grpo"}]
    params.write_text(yaml.safe_dump(p))
    res = _run(params, root, "--endpoints", str(root / "ep"))
    assert res.exit_code == 0, res.output
    md = (root / "t.md").read_text()
    assert "| no_gain | its upper end below the smallest effect of interest | no gain of {cell} |" in md
    report = json.loads((root / "r.json").read_text())
    by = {e["name"]: e for e in report["endpoints"]}
    rc_pass1 = by["pass1: rctp-rc_grpo vs rctp-grpo"]
    # RC-GRPO's pass@1 is +0.25 on 8 of 20 entries in both seeds: +10 points, an interval above 0
    assert rc_pass1["ci"][0] > 0 and outcome(rc_pass1, "unit", 0.025) == "gain"
    assert "- pass1: rctp-rc_grpo vs rctp-grpo: **gain**" in md and "rctp-rc_grpo gains over rctp-grpo" in md
    zero = by["zero_variance: rctp-rc_grpo vs rctp-grpo"]  # flat 4 of 30 against 12 of 30: below 0
    assert zero["ci"][1] < 0.05 and outcome(zero, "unit", 0.05) == "no_gain" and "**no_gain**" in md
    q = by["q_after: rctp-rc_grpo"]  # the checks after RL read q - 0.15: 0.45 and 0.55
    assert q["per_seed"] == pytest.approx([0.45, 0.55]) and q["least"] == pytest.approx(0.45) and q["kept"] is False
    assert "least 0.45; q >= 0.5 in every seed: no" in md
    assert outcome({"ci": [-0.01, 0.03], "seed_level": {"ci": [0.001, 0.2]}}, "seed", 0.025) == "gain"
    assert outcome({"ci": [-0.01, 0.03], "seed_level": {"ci": [0.001, 0.2]}}, "unit", 0.025) == "inconclusive"
    got = CliRunner().invoke(endpoints_stage.app, ["--recompute", str(root / "ep"), "--check", str(root / "t.md")])
    assert got.exit_code == 0 and "equal to" in got.output, got.output


def test_the_premise_may_be_read_on_dev_beside_a_held_out_outcome(tmp_path):
    """Controllability checks on dev, evaluations on held-out: the report names each side where it is read and
    says the cross-stage check has no shared entry; checks of two sides are refused."""
    params, root = _grid(tmp_path)
    for s in (0, 1):
        for f in [root / "ctl" / f"{s}.json", *(root / "ctl" / str(s)).glob("*.json")]:
            write_json(f, {**json.loads(f.read_text()), "side": "dev"})
    res = _run(params, root)
    assert res.exit_code == 0, res.output
    md, data = (root / "t.md").read_text(), json.loads((root / "r.json").read_text())
    assert data["side"] == "test" and data["premise_side"] == "dev"
    assert "on the dev entries" in md and "## Outcome pooled over seeds (held-out entries)" in md
    assert "cross-stage check" in md and "not run" in md
    f = root / "ctl" / "1" / "rctp-grpo.json"
    write_json(f, {**json.loads(f.read_text()), "side": "test"})
    res = _run(params, root)
    assert res.exit_code == 2 and "a report reads one side of the split" in res.output
