"""Profiles say what they run: every profile, as it is run, resolved through the stages' configs into the
table of docs/profiles.md (`sweep.profiles`), which must be exactly what they resolve to now; the paper
profile equals the paper's setup row by row but where `PAPER_DEPARTURES` says why; `rcgrpo params --show`
prints what a profile changes, resolved, and writes nothing."""

from __future__ import annotations

import re
import shutil

import pytest
import yaml
from helpers import REPO_ROOT
from typer.testing import CliRunner

from rcgrpo_tasks.env.paper import PAPER_SETUP
from rcgrpo_tasks.ops import profiles
from rcgrpo_tasks.stages import params as params_stage
from rcgrpo_tasks.sweep import profiles as table

DOC = REPO_ROOT / "docs" / "profiles.md"


@pytest.fixture(scope="module")
def cols() -> dict:
    return table.columns(REPO_ROOT)


def _block(text: str) -> str:
    return re.search(re.escape(table.START) + ".*?" + re.escape(table.END), text, re.S).group(0)


def test_the_docs_table_is_what_every_profile_resolves_to(cols):
    assert _block(DOC.read_text()) == table.rendered(cols), "run `rcgrpo params --table docs/profiles.md`"


def test_every_profile_is_in_the_table_as_it_is_run():
    names = profiles.profile_names(REPO_ROOT, set(yaml.safe_load((REPO_ROOT / "params.yaml").read_text())))
    layers = {layer for run in table.PROFILES for layer in run.split("+")}
    assert set(names) <= layers, sorted(set(names) - layers)


def test_the_paper_profile_is_the_papers_setup_where_it_does_not_say_otherwise(cols):
    """Every row the paper gives: the `paper` column has the paper's value, or the row is a listed departure
    (and a listed departure is a real one). RCTP: 5 epochs over the whole set at the paper's lr and batch;
    RL: G=5, lr 1e-6, 256 prompts a step, clip 0.2, KL beta 0.1 unbounded, P(high) 0.5."""
    assert set(PAPER_SETUP) <= set(cols["paper"])
    assert set(table.departures(cols)) == set(table.PAPER_DEPARTURES)
    paper = cols["paper"]
    assert paper["RCTP"] == "5 epochs, batch 16, lr 1e-05, full" and paper["SFT"].startswith("2 epochs, batch 16")
    assert paper["RL steps x groups"] == "400 x 256 groups of G=5" and paper["RL lr, weights"] == "1e-06, full"
    assert (paper["KL beta (to the init)"], paper["PPO clip"], paper["RC-GRPO P(high), draw"]) == ("0.1", "0.2", "0.5, iid")


def test_a_value_a_profile_inherits_shows_and_fails_the_docs(tmp_path, cols):
    """params.yaml giving RCTP a step budget the paper profile does not override: its column says so, and the
    committed table no longer matches (the check above fails)."""
    root = tmp_path / "repo"
    shutil.copytree(REPO_ROOT / "configs", root / "configs")
    params = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    paper = yaml.safe_load((root / "configs" / "paper.yaml").read_text())
    del paper["sft"]["variants"]["rctp"]["max_steps"]
    (root / "configs" / "paper.yaml").write_text(yaml.safe_dump(paper, sort_keys=False))
    inherited = table.columns(root, ("paper",))
    steps = params["sft"]["variants"]["rctp"]["max_steps"]
    assert steps > 0 and inherited["paper"]["RCTP"] == f"{steps} steps, batch 16, lr 1e-05, full"
    assert "RCTP" in table.departures(inherited)
    assert table.rendered({**cols, **inherited}) != _block(DOC.read_text())


def test_show_prints_what_a_profile_changes_resolved_and_writes_nothing(monkeypatch):
    monkeypatch.chdir(REPO_ROOT)
    before = (REPO_ROOT / "params.yaml").read_bytes()
    res = CliRunner().invoke(params_stage.app, ["--profile", "paper", "--show"])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert lines[0].startswith("profile paper against ") and "nothing written" in lines[0]
    steps = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())["sft"]["variants"]["rctp"]["max_steps"]
    assert f"  sft.variants.rctp.max_steps: {steps} -> -1" in lines  # the variant as it trains
    assert "  sft.variants.rctp.init: sft -> sft" not in lines and "  rl.kl_token_max: 10.0 -> null" in lines
    assert "  sft.variants.sft.learning_rate: 0.001 -> 1.0e-05" in lines  # a shared value the variant inherits
    assert int(lines[0].split(": ")[1].split()[0]) == len(lines) - 1
    assert (REPO_ROOT / "params.yaml").read_bytes() == before
    res = CliRunner().invoke(params_stage.app, ["--profile", "default", "--show"])
    assert res.exit_code == 0 and ": 0 key(s) change" in res.output


def test_changes_names_every_leaf_that_differs_and_only_those():
    before = {"a": {"b": 1, "c": [1, 2], "gone": 0}, "d": None}
    after = {"a": {"b": 1, "c": [1, 3], "new": {"x": 1}}, "d": None}
    got = {k: (a, b) for k, a, b in profiles.changes(before, after)}
    assert got == {"a.c": ([1, 2], [1, 3]), "a.new": (profiles.UNSET, {"x": 1}), "a.gone": (0, profiles.UNSET)}
    assert profiles.changes(after, after) == []
