"""The endpoints' statistics agree with themselves: each from one procedure at the unit level, a seed-level t
beside it (checked on the study's own per-seed numbers), the MDE as the range between the two, no degenerate
interval printed; the committed per-unit files give back the report's table (`rcgrpo endpoints --recompute`);
the mechanism's parts counted on a hand-built pair of rollout logs."""

from __future__ import annotations

import json
import math

import pytest
import yaml
from test_seeded_report import _grid, _run
from typer.testing import CliRunner

from rcgrpo.stats import mcnemar_exact
from rcgrpo_tasks.evaluation import endpoints as ep
from rcgrpo_tasks.evaluation.endpoint_tables import endpoints_table
from rcgrpo_tasks.evaluation.mechanism_tables import crosstab
from rcgrpo_tasks.evaluation.stats import t_summary, tango_paired_ci
from rcgrpo_tasks.stages import endpoints as endpoints_stage
from rcgrpo_tasks.train.rl.diagnostics import group_flags

# The study's zero-variance groups per seed (results/study, 120 paired groups a seed): only RC-GRPO flat, only
# GRPO flat. Pooled 30 vs 63 of 360: McNemar p 0.00081, Tango [-0.1442, -0.0400]; per seed -6, -13, -14 / 120.
STUDY = ((5, 11), (18, 31), (7, 21))


def _zero_variance_data(counts=STUDY, n=120) -> dict:
    pairs = [[[1.0, 0.0]] * b + [[0.0, 1.0]] * c + [[0.0, 0.0]] * (n - b - c) for b, c in counts]
    return {"measure": "zero_variance", "seeds": list(range(len(counts))), "unit": "groups",
            "units": [[f"{i // 4}:{i % 4}" for i in range(n)] for _ in counts], "pairs": pairs}


def test_the_seed_level_t_on_the_studys_per_seed_differences():
    """By hand: mean -0.0917, sd 0.0364 over 3 seeds, se 0.0210, t = -4.37 on 2 df: p = 0.0486."""
    r = t_summary([-6 / 120, -13 / 120, -14 / 120])
    m = -33 / 360
    sd = math.sqrt(sum((x - m) ** 2 for x in (-6 / 120, -13 / 120, -14 / 120)) / 2)
    assert r["diff"] == pytest.approx(m) and r["se"] == pytest.approx(sd / math.sqrt(3)) and r["df"] == 2
    assert m / r["se"] == pytest.approx(-4.371, abs=1e-3) and r["p"] == pytest.approx(0.0486, abs=1e-4)
    assert r["ci"] == pytest.approx([m - 4.3027 * r["se"], m + 4.3027 * r["se"]], abs=1e-4)
    assert r["mde"] == pytest.approx((4.3027 + 1.0607) * r["se"], abs=1e-4)  # t quantiles of 2 df, power 0.8


def test_a_group_endpoint_gives_mcnemar_at_the_unit_level_and_the_t_beside_it():
    r = ep.endpoint_stats(_zero_variance_data(), 0.05, 0.8)
    assert (r["only_first"], r["only_second"], r["n"]) == (30, 63, 360)
    assert r["p"] == pytest.approx(0.000810, abs=2e-6) == mcnemar_exact(30, 63)
    assert r["ci"] == pytest.approx(list(tango_paired_ci(30, 63, 360))) and r["ci"][0] == pytest.approx(-0.1442, abs=1e-4)
    assert r["mde"] == pytest.approx(2.8016 * math.sqrt(93 / 360) / math.sqrt(360), abs=1e-4)  # 0.075
    assert r["per_seed"] == pytest.approx([-6 / 120, -13 / 120, -14 / 120])
    assert r["seed_level"]["p"] == pytest.approx(0.0487, abs=5e-4) and r["seed_level"]["df"] == 2
    assert r["mde_range"] == [r["mde"], r["seed_level"]["mde"]] and r["mde_range"][0] < r["mde_range"][1]


def test_pass1_is_one_t_over_seed_averaged_entries_beside_the_seed_t():
    diffs = [[0.25, 0.0, -0.125, 0.5], [0.125, 0.0, 0.0, 0.25], [0.0, 0.125, -0.25, 0.375]]
    data = {"measure": "pass1", "seeds": [0, 1, 2], "unit": "entries", "units": [["a", "b", "c", "d"]] * 3,
            "pairs": [[[0.5 + d, 0.5] for d in ds] for ds in diffs]}
    r = ep.endpoint_stats(data, 0.05, 0.8)
    averaged = [sum(col) / 3 for col in zip(*diffs)]
    assert ep.unit_differences(data) == pytest.approx(averaged)
    unit = t_summary(averaged)
    assert r["diff"] == pytest.approx(unit["diff"]) and r["ci"] == pytest.approx(unit["ci"])
    assert r["p"] == pytest.approx(unit["p"]) and r["mde"] == pytest.approx(unit["mde"])  # one model: t, 3 df
    seed = t_summary([sum(d) / 4 for d in diffs])
    assert r["seed_level"]["p"] == pytest.approx(seed["p"]) and r["seed_level"]["ci"] == pytest.approx(seed["ci"])
    assert r["mde_range"] == pytest.approx(sorted([unit["mde"], seed["mde"]]))
    shuffled = {**data, "units": [["d", "c", "b", "a"], *data["units"][1:]]}  # entries pair by id, not position
    assert ep.unit_differences(shuffled)[0] == pytest.approx((diffs[0][3] + diffs[1][0] + diffs[2][0]) / 3)


def test_no_degenerate_interval_is_printed():
    same = t_summary([0.1] * 5)
    assert math.isnan(same["p"]) and all(math.isnan(x) for x in same["ci"]) and same["diff"] == pytest.approx(0.1)
    noisy = t_summary([0.3 - 0.25] * 6 + [0.05])  # equal up to float rounding: no interval either
    assert all(math.isnan(x) for x in noisy["ci"])
    data = {"measure": "token_gap", "seeds": [0, 1], "unit": "entries", "units": [["a", "b"]] * 2,
            "pairs": [[[0.3, 0.25], [0.3, 0.25]]] * 2}
    row = {"rank": "secondary", "name": "token_gap: x vs rctp", "spec": {"measure": "token_gap"},
           **ep.endpoint_stats(data, 0.05, 0.8)}
    zero = {"rank": "primary", "name": "zero_variance: x vs y", "spec": {"measure": "zero_variance"},
            **ep.endpoint_stats(_zero_variance_data(((0, 0), (0, 0))), 0.05, 0.8)}
    table = endpoints_table([zero, row], 0.05, 0.8, 2)
    assert "[+0.000, +0.000]" not in table and "[-0.050, -0.050]" not in table
    assert "+0.050 [no spread: no interval]" not in table and "n/a" in table
    assert "+0.000 [-0.016, +0.016]" in table  # b = c = 0 of 240: Tango's interval is never a point


def test_the_endpoints_recompute_from_the_committed_files_and_equal_the_report(tmp_path):
    params, root = _grid(tmp_path, seeds=(0, 1, 2), gate_q=(0.45, 0.35, 0.4))
    p = yaml.safe_load(params.read_text())
    p["endpoints"]["secondary"] += [{"measure": m, "cell": "rctp-rc_grpo", "versus": "rctp-grpo"}
                                    for m in ("flat_fail", "flat_success", "nonzero_adv_high")]
    p["endpoints"]["secondary"] += [{"measure": "token_gap", "cell": "rctp-rc_grpo", "versus": "rctp"},
                                    {"measure": "probe", "cell": "rctp-grpo"},
                                    {"measure": "pass1", "cell": "rctp-rc_grpo", "versus": "rctp"}]
    params.write_text(yaml.safe_dump(p))
    folder = root / "endpoints"
    res = _run(params, root, "--endpoints", str(folder))
    assert res.exit_code == 0, res.output
    index = json.loads((folder / ep.INDEX).read_text())
    assert len(index["endpoints"]) == 11 and index["seeds"] == 3
    report = json.loads((root / "r.json").read_text())  # the pooled table's "vs init" is the endpoint's procedure
    end = next(e for e in report["endpoints"] if e["name"] == "pass1: rctp-rc_grpo vs rctp")
    vs = next(r for r in report["pooled"] if r["label"] == "rctp-rc_grpo")["vs"]["pass1"]
    assert vs["diff"] == pytest.approx(100 * end["diff"]) and vs["ci"] == pytest.approx([100 * x for x in end["ci"]])
    got = json.loads((folder / index["endpoints"][1]["file"]).read_text())  # pass1: 3 seeds x 20 entries
    assert got["name"] == "pass1: rctp-rc_grpo vs rctp-grpo" and [len(u) for u in got["data"]["units"]] == [20] * 3
    runner = CliRunner()
    out = runner.invoke(endpoints_stage.app, ["--recompute", str(folder), "--check", str(root / "t.md")])
    assert out.exit_code == 0, out.output
    assert "equal to" in out.output and endpoints_stage.table_section((root / "t.md").read_text()) in out.output
    # a changed per-unit value changes the table, and the check says where
    first = folder / index["endpoints"][0]["file"]
    row = json.loads(first.read_text())
    row["data"]["pairs"][0][0] = [0.0, 0.0]  # was flat in both
    first.write_text(json.dumps(row))
    out = runner.invoke(endpoints_stage.app, ["--recompute", str(folder), "--check", str(root / "t.md")])
    assert out.exit_code == 1 and "differs" in out.output and "zero_variance" in out.output


def _log(flats: list[tuple[str | None, str | None]], g: int = 4) -> tuple[list[dict], list[dict]]:
    """Two runs' rollout logs (GRPO, RC-GRPO) whose paired groups have the given flat types."""
    rewards = {None: [1.0, 0.0, 1.0, 0.0], "fail": [0.0] * g, "success": [1.0] * g}
    runs = ([], [])
    for i, pair in enumerate(flats):
        for run, flat in zip(runs, pair):
            run += [{"step": i // 4, "group": i % 4, "entry_id": f"e{i}", "reward_token": None,
                     "rewards": {"paper_reward": r}, "advantage": 0.0} for r in rewards[flat]]
    return runs


def test_the_mechanism_parts_of_a_hand_built_pair_of_rollout_logs():
    """The study's cross-tab (GRPO's flat type x RC-GRPO's over 360 groups): 45 of the 63 groups only GRPO had
    flat were flat at success, 18 at failure; RC-GRPO made 24 groups flat at failure and 7 at success."""
    table = {(None, None): 160, (None, "fail"): 23, (None, "success"): 7, ("fail", None): 18, ("fail", "fail"): 44,
             ("success", None): 45, ("success", "fail"): 1, ("success", "success"): 62}
    flats = [pair for pair, n in table.items() for _ in range(n)]
    grpo, rc = _log(flats)
    c = crosstab(group_flags(rc, "paper_reward"), group_flags(grpo, "paper_reward"))
    assert c == {"groups": 360, "rescued_success": 45, "rescued_failure": 18, "created_fail": 24, "created_success": 7,
                 "versus_fail": 62, "cell_fail": 68, "versus_success": 108, "cell_success": 69}
    other = [dict(r, entry_id="x") for r in rc[:4]] + rc[4:]  # a pair whose entries differ is not a pair
    assert crosstab(group_flags(other, "paper_reward"), group_flags(grpo, "paper_reward"))["groups"] == 359


def test_every_profile_declares_endpoints_its_grid_can_measure():
    """Before anything runs: each endpoint of each profile names models its grid trains or evaluates; a group
    measure pairs two RL cells of one init; a token gap reads an RCTP model or an RCTP-init cell (they alone
    have a premise); a transfer half needs prompts outside the pool."""
    from helpers import REPO_ROOT

    from rcgrpo_tasks.evaluation.grid import GridConfig
    from rcgrpo_tasks.ops.config import from_dict
    from rcgrpo_tasks.ops.profiles import resolve_profile
    from rcgrpo_tasks.sweep.profiles import PROFILES

    for profile in PROFILES:
        params = resolve_profile(profile, REPO_ROOT).merged
        grid = from_dict(GridConfig, params["grid"], profile)
        declared = from_dict(ep.EndpointsConfig, params["endpoints"], profile)
        models = {*grid.cells, *grid.seeded_labels, *grid.labels}
        for _, e in declared.all():
            named = [e["cell"], *([e["versus"]] if "versus" in e else [])]
            assert set(named) <= models, (profile, e)
            if ep.UNITS.get(e["measure"]) == "groups" or e["measure"] in ep.SINGLE:
                assert set(named) <= set(grid.cells), (profile, e)
            if e["measure"] == "token_gap":
                assert all(n == "rctp" or n.startswith("rctp-") for n in named), (profile, e)
            if e["measure"] == "transfer":
                rl = params["rl"]
                outside = rl["pool_band"] is not None or rl["max_entries"] is not None  # else the pool is every prompt
                assert rl["probe_transfer_entries"] > 0 and outside, (profile, e)
