"""generate_trajectories: perturbations, balancing, and the stage on a few real BFCL entries."""

from __future__ import annotations

import json
import random

import pytest
from helpers import compute_from_params, config_from_params

from rcgrpo_tasks.data.dataset import GenerateConfig, allocate, check_task, draw_failures, generate
from rcgrpo_tasks.engine.compute import resolve_compute
from rcgrpo_tasks.env.entries import split_entries
from rcgrpo_tasks.env.multi_turn.calls import parse_call_string
from rcgrpo_tasks.env.multi_turn.entries import Entry, load_entries
from rcgrpo_tasks.env.multi_turn.perturb import PERTURBATIONS, entry_functions, perturb
from rcgrpo_tasks.env.multi_turn.scoring import score_entry
from rcgrpo_tasks.env.prompt import PromptConfig
from rcgrpo_tasks.env.tasks import TASKS
from rcgrpo_tasks.ops.config import ConfigError
from rcgrpo_tasks.ops.inputs import InputError

PAPER = config_from_params(PromptConfig, "prompt", system_prompt="bfcl")
MULTI_MIX = {"policy": 0.1, **{k: 0.15 for k in ("wrong_arg_value", "wrong_function", "dropped_call",
                                                 "extra_call", "stop_early", "wrong_turn")}}
"""failure_mix over the multi-turn task's near-miss kinds."""


def multi_turn_config(**kw) -> GenerateConfig:
    """A GenerateConfig for multi-turn entries: up to 20 outputs of 64 tokens an episode, `MULTI_MIX`."""
    return config_from_params(GenerateConfig, "generate_trajectories", **{
        "temperature": 1.0, "max_outputs": 20, "max_new_tokens": 64, "failure_mix": MULTI_MIX, **kw})


@pytest.fixture(scope="module")
def entries() -> list[Entry]:
    return load_entries()


# ---------------------------------------------------------------------------------------------------
# Perturbations


@pytest.mark.parametrize("kind", PERTURBATIONS)
def test_perturbation_changes_script_and_is_deterministic(entries, kind):
    n_applied = 0
    for entry in entries[::40]:
        p = perturb(entry, kind, random.Random(f"t:{entry.id}"))
        again = perturb(entry, kind, random.Random(f"t:{entry.id}"))
        assert p == again
        if p is None:
            continue
        n_applied += 1
        assert p.kind == kind and p.detail
        assert p.turns != entry.ground_truth
        assert len(p.turns) == len(entry.ground_truth)  # turn structure kept
        for turn in p.turns:
            for call in turn:
                parse_call_string(call)  # every perturbed call is still a well-formed call
    assert n_applied >= 15


def test_perturbation_kinds_do_what_they_say(entries):
    entry = entries[0]
    gold = [c for t in entry.ground_truth for c in t]
    n_gold = len(gold)
    rng = lambda: random.Random(3)  # noqa: E731
    assert sum(map(len, perturb(entry, "dropped_call", rng()).turns)) == n_gold - 1
    assert sum(map(len, perturb(entry, "extra_call", rng()).turns)) == n_gold + 1
    stop = perturb(entry, "stop_early", rng())
    flat = [c for t in stop.turns for c in t]
    assert len(flat) < n_gold and flat == gold[: len(flat)]  # a prefix of the gold calls
    moved = perturb(entry, "wrong_turn", rng())
    assert sorted(c for t in moved.turns for c in t) == sorted(gold)
    assert [len(t) for t in moved.turns] != [len(t) for t in entry.ground_truth]
    wrong_fn = perturb(entry, "wrong_function", rng())
    before = [parse_call_string(c) for t in entry.ground_truth for c in t]
    after = [parse_call_string(c) for t in wrong_fn.turns for c in t]
    (old, new), = [(a, b) for a, b in zip(before, after) if a != b]
    funcs = entry_functions(entry)
    assert new.name != old.name and funcs[new.name][0] == funcs[old.name][0]  # a sibling of the same class
    assert new.kwargs == old.kwargs and new.args == old.args
    wrong_arg = perturb(entry, "wrong_arg_value", rng())
    (old, new), = [(a, b) for a, b in zip(before, [parse_call_string(c) for t in wrong_arg.turns for c in t]) if a != b]
    assert old.name == new.name and (old.args, old.kwargs) != (new.args, new.kwargs)


def test_unknown_perturbation_rejected(entries):
    with pytest.raises(ValueError, match="unknown perturbation"):
        perturb(entries[0], "teleport", random.Random(0))


# ---------------------------------------------------------------------------------------------------
# Balancing


def test_allocate_is_exact_and_proportional():
    q = allocate(100, {"a": 0.5, "b": 0.25, "c": 0.25})
    assert q == {"a": 50, "b": 25, "c": 25}
    q = allocate(7, {"a": 1, "b": 1, "c": 1})
    assert sum(q.values()) == 7 and max(q.values()) - min(q.values()) <= 1


def test_draw_failures_hands_short_quota_to_others():
    sources = {"policy": ["p1"], "x": (f"x{i}" for i in range(100)), "y": (f"y{i}" for i in range(100))}
    taken = draw_failures(20, {"policy": 0.5, "x": 0.25, "y": 0.25}, sources)
    assert taken["policy"] == ["p1"]
    assert len(taken["x"]) + len(taken["y"]) == 19 and abs(len(taken["x"]) - len(taken["y"])) <= 1
    # Everything dry: take what exists, stop.
    taken = draw_failures(50, {"a": 1.0, "b": 1.0}, {"a": ["a1"], "b": ["b1", "b2"]})
    assert sorted(taken["a"] + taken["b"]) == ["a1", "b1", "b2"]


@pytest.mark.parametrize("bad", [
    {"success_fraction": 1.0},
    {"failure_mix": {"policy": 1.0, "teleport": 1.0}},
    {"failure_mix": {"policy": 0.0}},
    {"reward": "partial_credit"},
    {"near_miss_attempts": 0},
    {"colour": "blue"},
])
def test_bad_generate_config_rejected(bad):
    with pytest.raises(ConfigError):
        config_from_params(GenerateConfig, "generate_trajectories", **bad)


def test_official_verdict_needs_the_official_prompt_on_multi_turn_only():
    multi, single = TASKS["multi_turn"], TASKS["single_turn"]
    with pytest.raises(ConfigError, match="official_verdict"):
        check_task(multi_turn_config(reward="official_verdict"), config_from_params(PromptConfig, "prompt", protocol="paper", system_prompt="bfcl"), multi)
    check_task(multi_turn_config(reward="official_verdict"), config_from_params(PromptConfig, "prompt", protocol="official", system_prompt="bfcl"), multi)
    single_mix = {"policy": 0.1, "wrong_arg_value": 0.5, "missing_param": 0.4}
    check_task(config_from_params(GenerateConfig, "generate_trajectories", reward="official_verdict", failure_mix=single_mix), config_from_params(PromptConfig, "prompt", protocol="paper", system_prompt="bfcl"),
               single)


def test_failure_mix_kinds_must_be_the_tasks():
    with pytest.raises(ConfigError, match=r"\['stop_early', 'wrong_turn'\] are not near-miss kinds of the single_turn"):
        check_task(multi_turn_config(), config_from_params(PromptConfig, "prompt", system_prompt="bfcl"), TASKS["single_turn"])
    with pytest.raises(ConfigError, match="missing_param"):
        check_task(config_from_params(GenerateConfig, "generate_trajectories", failure_mix={"missing_param": 1.0}), config_from_params(PromptConfig, "prompt", system_prompt="bfcl"), TASKS["multi_turn"])


# ---------------------------------------------------------------------------------------------------
# Inputs


def write_inputs(tmp_path, entries: list[Entry], n_train: int, n_test: int = 4):
    """entries.jsonl + split.json as prepare_data writes them (first n_train train, next n_test test)."""
    chosen = entries[: n_train + n_test]
    path = tmp_path / "entries.jsonl"
    path.write_text("".join(json.dumps(e.to_json()) + "\n" for e in chosen))
    split = tmp_path / "split.json"
    split.write_text(json.dumps({"train": [e.id for e in chosen[:n_train]],
                                 "test": [e.id for e in chosen[n_train:]]}))
    return path, split


def test_corrupt_entries_line_names_file_and_line(tmp_path, entries):
    path, split = write_inputs(tmp_path, entries, 3)
    lines = path.read_text().splitlines()
    lines[1] = lines[1][:50]  # truncated JSON on line 2
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(InputError, match=r"entries\.jsonl:2"):
        split_entries(path, split, "train")


def test_split_must_match_entries(tmp_path, entries):
    path, split = write_inputs(tmp_path, entries, 3)
    split.write_text(json.dumps({"train": ["multi_turn_base_999"], "test": []}))
    with pytest.raises(InputError, match="not in"):
        split_entries(path, split, "train")
    split.write_text(json.dumps({"train": [entries[0].id], "test": [entries[0].id]}))
    with pytest.raises(InputError, match="both train and test"):
        split_entries(path, split, "train")
    split.write_text(json.dumps({"train": [entries[0].id], "dev": [entries[0].id], "test": []}))
    with pytest.raises(InputError, match="both train and dev"):
        split_entries(path, split, "train")
    split.write_text(json.dumps({"train": [entries[0].id], "dev": "x", "test": []}))
    with pytest.raises(InputError, match="'dev'"):
        split_entries(path, split, "train")
    split.write_text(json.dumps({"train": [entries[0].id], "test": [entries[1].id]}))  # written before dev existed
    assert [e.id for e in split_entries(path, split, "train")] == [entries[0].id]
    with pytest.raises(InputError, match="dev side is empty"):
        split_entries(path, split, "dev")


# ---------------------------------------------------------------------------------------------------
# The stage on real entries (scripted replays through the rollout engine; no model weights needed)


@pytest.fixture(scope="module")
def generated(tmp_path_factory, entries, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("generate")
    entries_path, split = write_inputs(tmp, entries[::25], n_train=12, n_test=4)
    cfg = multi_turn_config(policy_entries=0)
    rows, metrics = generate(cfg, PAPER, entries_path, split, tiny_model_dir)
    return {"cfg": cfg, "rows": rows, "metrics": metrics, "entries_path": entries_path, "split": split,
            "by_id": {e.id: e for e in entries}}


def test_experts_score_one_and_near_misses_score_zero(generated):
    rows, by_id = generated["rows"], generated["by_id"]
    sources = {t.provenance["source"] for t in rows}
    assert sources == {"expert", "near_miss"}
    for t in rows:
        # Re-score the recorded calls independently of the stored score: verified, not assumed.
        fresh = score_entry(by_id[t.entry_id], t.result)
        want = 1.0 if t.provenance["source"] == "expert" else 0.0
        assert fresh.paper_reward == t.score["paper_reward"] == t.provenance["reward"] == want, t.trajectory_id
    experts = [t for t in rows if t.provenance["source"] == "expert"]
    assert len(experts) == 12 - generated["metrics"]["experts_too_long"]
    for t in experts:
        assert t.provenance["script_score"]["valid"] is True  # the official verdict on the per-turn script
        tools = [m for m in t.messages if m["role"] == "tool"]
        assert tools and all(m["content"] != '{"status": "success"}' for m in tools)  # real observations


def test_balanced_with_provenance_and_unique_ids(generated):
    rows, m = generated["rows"], generated["metrics"]
    assert m["n_success"] == m["n_failure"] == len(rows) // 2 and m["success_fraction"] == 0.5
    assert len({t.trajectory_id for t in rows}) == len(rows)
    kinds = {t.provenance["kind"] for t in rows if t.provenance["source"] == "near_miss"}
    assert len(kinds) >= 4  # the failure mix spreads over perturbation kinds
    for t in rows:
        p = t.provenance
        assert {"source", "kind", "generator", "model", "reward_fn", "reward", "perturbation", "script_score"} <= set(p)
        assert p["reward_fn"] == "paper_reward" and t.score is not None
        assert (p["perturbation"] is None) == (p["source"] == "expert")
        assert len(t.token_ids) <= m["max_tokens"]


def test_generation_is_deterministic(generated, tiny_model_dir):
    again, _ = generate(generated["cfg"], PAPER, generated["entries_path"], generated["split"], tiny_model_dir)
    strip = lambda ts: [{**t.to_json(), "wall_time_s": 0} for t in ts]  # noqa: E731
    assert strip(again) == strip(generated["rows"])


def test_official_protocol_and_verdict(tmp_path, entries, tiny_model_dir):
    entries_path, split = write_inputs(tmp_path, entries[1::100], n_train=4)
    cfg = multi_turn_config(reward="official_verdict", policy_entries=0)
    rows, m = generate(cfg, config_from_params(PromptConfig, "prompt", protocol="official", system_prompt="bfcl"), entries_path, split, tiny_model_dir)
    assert m["n_success"] == m["n_failure"] > 0
    for t in rows:
        assert t.protocol == "official" and len(t.result) == len(generated_turns(entries, t.entry_id))
        assert t.score["valid"] is (t.provenance["source"] == "expert")


def generated_turns(entries, entry_id):
    return next(e for e in entries if e.id == entry_id).ground_truth


def test_policy_rows_record_their_sampler(tmp_path, entries, tiny_model_dir):
    entries_path, split = write_inputs(tmp_path, entries[::100], n_train=3)
    cfg = config_from_params(GenerateConfig, "generate_trajectories", **{"policy_entries": 1, "policy_samples": 2, "max_new_tokens": 4,
                                     "temperature": 0.7, "dtype": "float32", "max_outputs": 20,
                                     "failure_mix": {"policy": 1.0, "dropped_call": 1.0}})
    compute = resolve_compute(compute_from_params(), decode=cfg.decode.dtype)  # as the stage resolves it
    rows, m = generate(cfg, PAPER, entries_path, split, tiny_model_dir, compute)
    assert m["policy"]["n"] == 2
    policy = [t for t in rows if t.provenance["source"] == "policy"]
    assert policy and m["by_kind"].get("policy") == len(policy)
    for t in policy:
        assert t.provenance["model"] == str(tiny_model_dir) and t.provenance["generator"] == "policy"
        assert t.provenance["sampling"]["temperature"] == 0.7 and t.provenance["sampling"]["max_new_tokens"] == 4
        assert sum(t.completion_mask) == t.n_model_tokens > 0
    assert m["n_success"] == m["n_failure"]


def test_max_entries_samples_train_only(tmp_path, entries, tiny_model_dir):
    entries_path, split = write_inputs(tmp_path, entries[::60], n_train=8, n_test=5)
    cfg = multi_turn_config(policy_entries=0, max_entries=3)
    rows, m = generate(cfg, PAPER, entries_path, split, tiny_model_dir)
    test_ids = set(json.loads(split.read_text())["test"])
    assert m["n_entries_used"] == 3 and m["n_train_entries"] == 8
    assert len({t.entry_id for t in rows if t.provenance["source"] == "expert"}) <= 3
    assert not {t.entry_id for t in rows} & test_ids


# ---------------------------------------------------------------------------------------------------
# The single-turn task through the same stage


SINGLE_MIX = {"policy": 0.1, "wrong_arg_value": 0.3, "missing_param": 0.15, "wrong_function": 0.15,
              "extra_call": 0.15, "dropped_call": 0.15}


def test_single_turn_set_experts_pass_bfcl_and_near_misses_fail(tmp_path, tiny_model_dir):
    from rcgrpo_tasks.env.single_turn import entries as single_turn

    entries = single_turn.load_entries(single_turn.DEFAULT_CATEGORIES)[::20]
    entries_path, split = write_inputs(tmp_path, entries, n_train=40)
    cfg = config_from_params(GenerateConfig, "generate_trajectories", policy_entries=0, failure_mix=SINGLE_MIX,
                             temperature=1.0, max_outputs=20, max_new_tokens=64)
    rows, m = generate(cfg, PAPER, entries_path, split, tiny_model_dir)
    assert m["task"] == "single_turn" and m["n_success"] == m["n_failure"] > 30
    assert set(m["near_miss_tried"]) == set(TASKS["single_turn"].perturbations)
    by_id = {e.id: e for e in entries}
    for t in rows:
        assert t.provenance["task"] == "single_turn" and t.n_steps == 1 and t.termination == "completed"
        fresh = TASKS["single_turn"].score(by_id[t.entry_id], t.result)  # re-scored from the recorded calls
        assert fresh.valid is t.score["valid"] is (t.provenance["source"] == "expert"), t.trajectory_id
        assert [m["role"] for m in t.messages][-1] == "assistant" and t.messages[-1]["content"].startswith("[")
    assert {t.provenance["kind"] for t in rows if t.provenance["source"] == "near_miss"} >= {
        "wrong_arg_value", "missing_param", "wrong_function"}
