"""Split by numeric id: deterministic, 60/20/10/10 (train/rl/dev/test) per category, no overlap, variants kept
together; RL's side carved after dev, leaving the held-out and dev sides as they were."""

import json
import subprocess
import sys

import pytest
from helpers import config_from_params, write_params

from rcgrpo_tasks.env.multi_turn.entries import Entry, category_of, numeric_id
from rcgrpo_tasks.env.split import PrepareDataConfig, prepare, split_metrics
from rcgrpo_tasks.ops.config import ConfigError


def test_split_is_480_160_80_80_without_overlap_and_deterministic():
    entries, split = prepare(config_from_params(PrepareDataConfig, "prepare_data", task="multi_turn", categories=None))
    sides = [set(split[k]) for k in ("train", "rl", "dev", "test")]
    assert [len(s) for s in sides] == [480, 160, 80, 80]
    assert all(a.isdisjoint(b) for i, a in enumerate(sides) for b in sides[i + 1:])
    assert set().union(*sides) == {e.id for e in entries}
    families = [{numeric_id(i) for i in side} for side in sides]
    assert all(a.isdisjoint(b) for i, a in enumerate(families) for b in families[i + 1:])
    assert sorted(families[2]) == split["dev_numeric_ids"] and sorted(families[1]) == split["rl_numeric_ids"]
    counts = split_metrics(split)["per_category"]
    assert all(c == {"train": 120, "rl": 40, "dev": 20, "test": 20} for c in counts.values())
    assert prepare(config_from_params(PrepareDataConfig, "prepare_data", task="multi_turn", categories=None))[1] == split
    assert prepare(config_from_params(PrepareDataConfig, "prepare_data", task="multi_turn", categories=None, seed=1))[1]["test"] != split["test"]


def test_rls_side_leaves_the_held_out_and_dev_sides_as_they_were():
    _, with_rl = prepare(config_from_params(PrepareDataConfig, "prepare_data", task="single_turn"))
    _, without = prepare(config_from_params(PrepareDataConfig, "prepare_data", task="single_turn", rl_fraction=0.0))
    assert with_rl["test"] == without["test"] and with_rl["dev"] == without["dev"] and without["rl"] == []
    assert set(with_rl["train"]) | set(with_rl["rl"]) == set(without["train"])
    counts = split_metrics(with_rl)["per_category"]
    assert counts["simple_python"]["rl"] == 80 and counts["multiple"]["rl"] == 40  # 20 % of each category


def test_the_dev_split_leaves_the_held_out_side_as_it_was():
    _, with_dev = prepare(config_from_params(PrepareDataConfig, "prepare_data", task="single_turn"))
    _, without = prepare(config_from_params(PrepareDataConfig, "prepare_data", task="single_turn", dev_fraction=0.0, rl_fraction=0.0))
    assert with_dev["test"] == without["test"] and without["dev"] == []
    assert set(with_dev["train"]) | set(with_dev["rl"]) | set(with_dev["dev"]) == set(without["train"])
    counts = split_metrics(with_dev)["per_category"]
    assert counts["simple_python"]["dev"] == counts["simple_python"]["test"] == 40
    assert counts["multiple"]["dev"] == counts["multiple"]["test"] == 20


def test_entries_round_trip_json():
    entries, _ = prepare(config_from_params(PrepareDataConfig, "prepare_data", task="multi_turn", categories=("miss_func",)))
    e = next(x for x in entries if x.missed_function)
    assert Entry.from_json(json.loads(json.dumps(e.to_json()))) == e
    assert category_of(e.id) == "miss_func"


@pytest.mark.parametrize("data,needle", [
    ({"test_fraction": 1.5}, "test_fraction"),
    ({"dev_fraction": 0.9}, "dev_fraction"),
    ({"dev_fraction": -0.1}, "dev_fraction"),
    ({"rl_fraction": 0.8}, "rl_fraction"),
    ({"rl_fraction": -0.1}, "rl_fraction"),
    ({"categories": ["nope"]}, "categories"),
    ({"seed": "zero"}, "seed"),
    ({"sede": 1}, "unknown key"),
])
def test_bad_params_fail_with_the_field_named(data, needle):
    with pytest.raises(ConfigError, match=needle):
        config_from_params(PrepareDataConfig, "prepare_data", **data)


def test_cli_writes_outputs_atomically(tmp_path):
    params = tmp_path / "params.yaml"
    write_params(params, {"prepare_data": {"task": "multi_turn", "categories": ["base"], "test_fraction": 0.1, "seed": 3}})
    out = [sys.executable, "-m", "rcgrpo_tasks.stages.prepare_data", "--params", str(params),
           "--entries", str(tmp_path / "e.jsonl"), "--split", str(tmp_path / "s.json")]
    subprocess.run(out, check=True, capture_output=True)
    assert len((tmp_path / "e.jsonl").read_text().splitlines()) == 200
    assert len(json.loads((tmp_path / "s.json").read_text())["test"]) == 20
    write_params(params, {"prepare_data": {"test_fraction": 2}})
    (tmp_path / "s.json").unlink()
    r = subprocess.run(out, capture_output=True, text=True)
    assert r.returncode != 0 and "test_fraction" in r.stderr and not (tmp_path / "s.json").exists()
    assert not list(tmp_path.glob(".*tmp"))
