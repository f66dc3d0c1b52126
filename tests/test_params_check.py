"""The whole params file checked before any stage works (`sweep.params_check`, the root stage `check_params`):
a bad value in any section, or a rule across sections broken, fails naming the file, the section and the field,
in seconds and with nothing written: in the check itself, in a real `dvc repro` whose earlier stages are cached,
in `rcgrpo plan` and in `rcgrpo params --profile`; the check adds no stage to DVC's lineage."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import REPO_ROOT, copy_tree
from typer.testing import CliRunner

from rcgrpo_tasks.ops.config import ConfigError, deep_merge, read_params
from rcgrpo_tasks.ops.profiles import profile_names
from rcgrpo_tasks.stages import check_params as check_stage
from rcgrpo_tasks.sweep.params_check import SECTIONS, check_file, check_params

BIN = Path(sys.executable).parent
BASE = read_params(REPO_ROOT / "params.yaml")
BAD = {  # section -> (key, a value its config refuses); the message must name both
    "prepare_data": ("task", "nope"), "prompt": ("protocol", "nope"), "compute": ("device", "tpu"),
    "grid": ("seeds", [0, 0]), "endpoints": ("alpha", 0.7), "prepare_model": ("dtype", "float8"),
    "evaluate": ("pass_samples", -1), "generate_trajectories": ("success_fraction", 2.0),
    "validate_trajectories": ("min_rows", -1), "label_rewards": ("thresholds", [2.0]),
    "sft": ("learning_rate", -1.0), "controllability": ("premise_min_q", 2.0),
    "sample_policy": ("temperature", -1.0), "rl": ("num_generations", 1), "promote": ("level", 2.0)}
ISSUE = {  # what every stage before the report used to accept: (section, key, value, what the error says)
    "duplicate seeds": ("grid", "seeds", [0, 0], "seeds: distinct integers >= 0, at least one, got [0, 0]"),
    "no seed": ("grid", "seeds", [], "seeds: distinct integers >= 0, at least one, got []"),
    "negative seed": ("grid", "seeds", [-1], "seeds: distinct integers >= 0, at least one, got [-1]"),
    "endpoint cell typo": ("endpoints", "primary", [{"measure": "zero_variance", "cell": "rctp-rc_grpx",
                                                     "versus": "rctp-grpo"}],
                           "primary[0].cell: 'rctp-rc_grpx' is not an RL cell of params grid"),
}


def _with(section: str, key: str, value) -> dict:
    params = copy.deepcopy(BASE)
    params[section][key] = value
    return params


def test_the_committed_params_and_every_profile_pass():
    assert set(check_file(REPO_ROOT / "params.yaml")) == set(SECTIONS) == set(BASE)
    layered = ["multi-turn+smoke", "gpu+smoke", "gpu+lease", "gpu+dryrun"]
    for profile in profile_names(REPO_ROOT, set(BASE)) + layered:
        merged = BASE
        for name in (n for n in profile.split("+") if n != "default"):
            merged = deep_merge(merged, read_params(REPO_ROOT / "configs" / f"{name}.yaml"))
        check_params(merged, profile)  # a profile's overlay, resolved


@pytest.mark.parametrize("section", sorted(BAD))
def test_a_bad_value_in_any_section_names_the_file_section_and_field(section):
    key, value = BAD[section]
    with pytest.raises(ConfigError) as err:
        check_params(_with(section, key, value), "params.yaml")
    message = str(err.value)
    assert message.startswith(f"params.yaml:{section}") and key in message and "\n" not in message, message


@pytest.mark.parametrize("case", sorted(ISSUE))
def test_what_only_the_report_refused_fails_first(case):
    section, key, value, said = ISSUE[case]
    with pytest.raises(ConfigError, match=f"^params.yaml:{section}: ") as err:
        check_params(_with(section, key, value), "params.yaml")
    assert said in str(err.value)


def test_rules_across_sections_and_every_problem_listed():
    params = _with("grid", "seeds", [])
    params["rl"]["probe_entries"] = 0  # the committed endpoints read the probe's transfer half
    params["endpoints"]["secondary"] = [*params["endpoints"]["secondary"],
                                        {"measure": "pass1", "cell": "base", "versus": "sft"},
                                        {"measure": "greedy", "cell": "rctp-dynamic", "versus": "rctp"}]
    params["unknown"] = {}
    del params["promote"]
    lines = str(pytest.raises(ConfigError, check_params, params, "p.yaml").value).splitlines()
    assert lines[:3] == [
        f"p.yaml: unknown section 'unknown'; sections: {sorted(SECTIONS)}",
        "p.yaml: missing section 'promote': every tuned value is written in the params file",
        "p.yaml:grid: seeds: distinct integers >= 0, at least one, got []"], lines
    assert len(lines) == 3  # the endpoints rule needs a valid grid: it adds nothing on a broken one
    params = _with("rl", "probe_entries", 0)
    with pytest.raises(ConfigError, match=r"endpoints: secondary\[\d+\].measure: transfer needs the fixed probe"):
        check_params(params, "p.yaml")
    params = _with("prompt", "protocol", "paper")
    params["prepare_data"]["task"], params["rl"]["reward"] = "multi_turn", "official_verdict"
    params["prepare_data"]["categories"] = None
    with pytest.raises(ConfigError, match="p.yaml:rl.reward: official_verdict is not defined for multi_turn"):
        check_params(params, "p.yaml")


def test_the_root_stage_command_writes_its_constant_output_only_when_the_params_hold(tmp_path):
    bad, out = tmp_path / "params.yaml", tmp_path / "checked"
    bad.write_text(yaml.safe_dump(_with("grid", "seeds", [-1])))
    res = CliRunner().invoke(check_stage.app, ["--params", str(bad), "--out", str(out)])
    assert res.exit_code == 2 and f"error: {bad}:grid: seeds" in res.output and not out.exists()
    bad.write_text(yaml.safe_dump(BASE))
    assert CliRunner().invoke(check_stage.app, ["--params", str(bad), "--out", str(out)]).exit_code == 0
    assert out.read_text() == check_stage.CHECKED == (REPO_ROOT / ".rcgrpo" / "params-checked").read_text()


def _run(repo: Path, *cmd: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_", "RCGRPO_"))}
    env.update({"PATH": f"{BIN}{os.pathsep}{env['PATH']}", "PYTHONPATH": str(repo),
                "MLFLOW_TRACKING_URI": f"sqlite:///{repo.parent}/mlflow.db"})
    return subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=600)


def _ran(done: subprocess.CompletedProcess) -> list[str]:
    """The stages DVC started (`Running stage 'X'`)."""
    return [ln.split("'")[1] for ln in done.stdout.splitlines() if ln.startswith("Running stage")]


def _state(repo: Path) -> dict[str, tuple]:
    """Every file outside .git/.dvc with its size and mtime: what "nothing written" compares."""
    return {str(p.relative_to(repo)): (p.stat().st_size, p.stat().st_mtime_ns) for p in repo.rglob("*")
            if p.is_file() and p.relative_to(repo).parts[0] not in (".git", ".dvc")}


def test_dvc_repro_plan_and_params_refuse_a_bad_value_at_once_with_earlier_stages_cached(tmp_path):
    """Refused before any stage works: the root check is the only stage DVC starts (`rcgrpo plan` and `rcgrpo
    params` start none), and nothing in the checkout is written or removed. How long a refusal takes is
    measured by bench/params_refusal.py, not here (a loaded host makes any bound a flake)."""
    repo = copy_tree(tmp_path / "repo")
    done = _run(repo, str(BIN / "dvc"), "repro", "prepare_data")  # the root and a first stage, recorded
    assert done.returncode == 0, done.stdout + done.stderr
    assert _ran(done) == ["check_params", "prepare_data"]
    good = (repo / "params.yaml").read_text()
    for case, (section, key, value, said) in ISSUE.items():
        (repo / "params.yaml").write_text(yaml.safe_dump(_with(section, key, value), sort_keys=False))
        before = _state(repo)
        for cmd in ([str(BIN / "dvc"), "repro"], [str(BIN / "rcgrpo"), "plan", "--out", "plan.json"]):
            done = _run(repo, *cmd)
            assert done.returncode != 0 and f"params.yaml:{section}: {said}" in done.stderr, (case, cmd, done.stderr)
            assert _ran(done) == (["check_params"] if cmd[0].endswith("dvc") else []), (case, cmd, done.stdout)
            assert _state(repo) == before, (case, cmd)  # nothing written, nothing removed
    (repo / "params.yaml").write_text(good)
    (repo / "configs" / "bad.yaml").write_text("grid:\n  seeds: []\n")
    before = _state(repo)
    done = _run(repo, str(BIN / "rcgrpo"), "params", "--profile", "bad")
    assert done.returncode == 2 and "grid: seeds: distinct integers" in done.stderr, done.stderr
    assert _ran(done) == [] and _state(repo) == before


def test_an_unrelated_section_reruns_the_check_alone_before_the_stages_that_name_it(tmp_path):
    """Lineage: the root check runs again (its dep is the whole file), its output does not change, so a stage
    that does not name the changed section stays up to date (tests/test_tuning.py: which stages do)."""
    repo = copy_tree(tmp_path / "repo")
    assert _run(repo, str(BIN / "dvc"), "repro", "prepare_data").returncode == 0
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["evaluate"]["limit"] = 30
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    status = _run(repo, str(BIN / "dvc"), "status", "--with-deps", "prepare_data").stdout
    assert "check_params:" in status and "prepare_data:" not in status, status
    done = _run(repo, str(BIN / "dvc"), "repro", "prepare_data")
    assert [ln.split("'")[1] for ln in done.stdout.splitlines() if ln.startswith("Running stage")] == ["check_params"]
    assert "up to date" in _run(repo, str(BIN / "dvc"), "status", "--with-deps", "prepare_data").stdout
