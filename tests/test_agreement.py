"""Two stages that decode the same model greedily on the same entries under the same token agree entry by entry
(`evaluation.agreement`): the verdicts on hand-built pairs, the controllability stage's greedy arm beside
evaluate's greedy answers on a real (tiny) model, and the report failing, writing nothing, when they part."""

from __future__ import annotations

import dataclasses
import json

import pytest
from helpers import HIGH, LEVELS, LOW, config_from_params, device_under_test
from typer.testing import CliRunner

from rcgrpo_tasks.engine.trajectory import Trajectory, write_trajectories
from rcgrpo_tasks.evaluation import agreement
from rcgrpo_tasks.ops.outputs import write_json, write_jsonl
from rcgrpo_tasks.stages import report as report_stage


def _traj(entry: str, tokens: list[int], lps: list[float], arm: str = "greedy", token: str | None = HIGH,
          success: bool = True) -> Trajectory:
    prompt = [1, 2, 3]
    return Trajectory(entry_id=entry, category="simple_python", protocol="paper", reward_token=token,
                      messages=[], token_ids=prompt + tokens, prompt_len=3, completion_mask=[0] * 3 + [1] * len(tokens),
                      logprobs=[0.0] * 3 + lps, result=[], termination="done", n_steps=1, n_model_tokens=len(tokens),
                      wall_time_s=0.0, score={"paper_reward": float(success), "valid": success},
                      provenance={"arm": arm, "sampling": {"max_new_tokens": 8}, "backend": {"dtype": "float32"}})


def test_verdicts_tell_a_near_tie_from_a_disagreement():
    a = _traj("e", [5, 6, 7], [-0.1, -0.7, -0.2])
    assert agreement.verdict(a, _traj("e", [5, 6, 7], [-0.1, -0.7, -0.2 + 5e-4]), 1e-3) == "identical"
    assert agreement.verdict(a, _traj("e", [5, 8, 9], [-0.1, -0.7004, -1.0]), 1e-3) == "tie"  # parted at a tie
    assert agreement.verdict(a, _traj("e", [5, 8, 9], [-0.1, -0.2, -1.0]), 1e-3) == "disagree"  # not a tie
    assert agreement.verdict(a, _traj("e", [5, 6, 7], [-0.1, -0.9, -0.2]), 1e-3) == "disagree"  # same tokens
    assert agreement.verdict(a, _traj("e", [5, 6], [-0.1, -0.7]), 1e-3) == "disagree"  # one stopped early
    got = agreement.compare([a, _traj("f", [1], [-0.1])], [_traj("e", [5, 8, 9], [-0.1, -0.2, -1.0])], 1e-3)
    assert (got["entries"], got["disagree"], got["disagreeing"]) == (1, 1, ["e"])


def test_controllability_greedy_arm_equals_evaluates_greedy_answers(rl_env):
    """The invariant the report checks, on a real model: controllability decodes each entry under each token
    in its own group, evaluate 16 entries to a session; their greedy answers under the high token agree."""
    from rcgrpo_tasks.engine.hf import HFBackend
    from rcgrpo_tasks.env.prompt import PromptConfig
    from rcgrpo_tasks.env.single_turn import entries as single_turn
    from rcgrpo_tasks.evaluation import controllability as ctl
    from rcgrpo_tasks.evaluation.accuracy import EvaluateConfig, run_eval

    _, model_dir = rl_env
    backend = HFBackend(model_dir, device=str(device_under_test()))
    pool = single_turn.load_entries(("simple_python", "multiple"))
    entries = [e for c in ("simple_python", "multiple") for e in [x for x in pool if x.category == c][:6]]
    prompt = config_from_params(PromptConfig, "prompt")
    cfg = config_from_params(ctl.ControllabilityConfig, "controllability", **{"max_new_tokens": 10, "batch_rows": 4, "margin": False})
    greedy = dataclasses.replace(cfg.decode, temperature=0.0).sampling(0)
    _, ctl_trajs = ctl.arm(cfg, backend, entries, prompt.protocol_config(1), greedy, 1, (HIGH, LOW), {"arm": "greedy"})
    ev = config_from_params(EvaluateConfig, "evaluate", **{"max_new_tokens": 10, "batch_rows": 16, "dtype": "float32", "pass_samples": 0})
    ev_trajs, _, _ = run_eval(ev, prompt, backend, entries, HIGH, "rctp", LEVELS)
    got = agreement.compare(ev_trajs, agreement.greedy_under(ctl_trajs, HIGH), agreement.TOL["float32"])
    assert got["entries"] == len(entries) and got["disagree"] == 0, got


def _report(tmp_path, other_lps: list[float]):
    """The report stage over one evaluation folder and another stage's trajectories of its entry."""
    ev = tmp_path / "eval"
    write_jsonl(ev / "results.jsonl", [{"id": "simple_python_0", "category": "simple_python", "valid": True,
                                        "official_valid": True, "partial_credit": 1.0, "paper_reward": 1.0}])
    write_json(ev / "metrics.json", {"settings": {"reward_token": HIGH, "side": "test"}})
    write_trajectories(ev / "trajectories.jsonl", [_traj("simple_python_0", [5, 6], [-0.1, -0.2])])
    other = tmp_path / "ctl.jsonl"
    write_trajectories(other, [_traj("simple_python_0", [5, 6], other_lps),
                               _traj("simple_python_0", [9], [-3.0], token=LOW)])
    out = tmp_path / "out"
    res = CliRunner().invoke(report_stage.app, ["--eval", f"rctp={ev}", "--agree", f"rctp={other}", "--no-track",
                                                "--table", str(out / "t.md"), "--json", str(out / "r.json"),
                                                "--plot", str(out / "a.png")])
    return res, out


def test_the_report_fails_and_writes_nothing_when_two_stages_disagree(tmp_path):
    res, out = _report(tmp_path, [-0.1, -0.2 + 1e-5])
    assert res.exit_code == 0, res.output
    check = json.loads((out / "r.json").read_text())["stage_agreement"][0]
    assert (check["entries"], check["identical"], check["disagree"]) == (1, 1, 0)
    assert "Cross-stage check" in (out / "t.md").read_text()
    res, out = _report(tmp_path / "b", [-0.1, -0.9])
    assert res.exit_code == 2 and "disagree on 1 of 1 entries" in res.output and "simple_python_0" in res.output
    assert not out.exists()


def test_a_check_with_no_shared_entry_is_an_error(tmp_path):
    with pytest.raises(agreement.InputError, match="no entry"):
        ev = tmp_path / "eval"
        write_json(ev / "metrics.json", {"settings": {"reward_token": HIGH, "side": "test"}})
        write_trajectories(ev / "trajectories.jsonl", [_traj("a", [1], [-0.1])])
        write_trajectories(tmp_path / "o.jsonl", [_traj("b", [1], [-0.1])])
        agreement.cross_check(ev, tmp_path / "o.jsonl")


def test_runs_with_other_budgets_are_not_compared(tmp_path):
    ev = tmp_path / "eval"
    write_json(ev / "metrics.json", {"settings": {"reward_token": HIGH, "side": "test"}})
    write_trajectories(ev / "trajectories.jsonl", [_traj("a", [1], [-0.1])])
    other = dataclasses.replace(_traj("a", [1], [-0.1]), provenance={"arm": "greedy", "sampling": {"max_new_tokens": 4}})
    write_trajectories(tmp_path / "o.jsonl", [other])
    with pytest.raises(agreement.InputError, match="other settings"):
        agreement.cross_check(ev, tmp_path / "o.jsonl")
