"""The single-turn task behind the task interface: entries, split, prompt, experts and near misses."""

import json
import random

import pytest
from helpers import config_from_params

from rcgrpo_tasks.env.prompt import PromptConfig
from rcgrpo_tasks.env.single_turn import entries as single_turn
from rcgrpo_tasks.env.single_turn.episode import initial_messages
from rcgrpo_tasks.env.single_turn.perturb import PERTURBATIONS, expert_answer, expert_calls, perturb
from rcgrpo_tasks.env.split import PrepareDataConfig, prepare, split_metrics
from rcgrpo_tasks.env.tasks import TASKS, entry_from_json, task_of, task_of_entries, task_of_id
from rcgrpo_tasks.ops.config import ConfigError


def test_split_is_stratified_seeded_and_complete():
    entries, split = prepare(config_from_params(PrepareDataConfig, "prepare_data", task="single_turn", categories=None))
    sides = [set(split[k]) for k in ("train", "rl", "dev", "test")]
    assert all(a.isdisjoint(b) for i, a in enumerate(sides) for b in sides[i + 1:]) and len(entries) == 1000
    assert set().union(*sides) == {e.id for e in entries}
    counts = split_metrics(split)["per_category"]
    assert counts == {"simple_python": {"train": 240, "rl": 80, "dev": 40, "test": 40},
                      "multiple": {"train": 120, "rl": 40, "dev": 20, "test": 20},
                      "parallel": {"train": 120, "rl": 40, "dev": 20, "test": 20},
                      "parallel_multiple": {"train": 120, "rl": 40, "dev": 20, "test": 20}}
    assert split["task"] == "single_turn" and split_metrics(split)["task"] == "single_turn"
    assert prepare(config_from_params(PrepareDataConfig, "prepare_data", task="single_turn", categories=None))[1] == split
    assert prepare(config_from_params(PrepareDataConfig, "prepare_data", task="single_turn", categories=None, seed=1))[1]["test"] != split["test"]


def test_live_categories_and_ids():
    entries, split = prepare(config_from_params(PrepareDataConfig, "prepare_data", task="single_turn", categories=("live_simple", "live_parallel")))
    assert {e.category for e in entries} == {"live_simple", "live_parallel"}
    assert len(split["test"]) == round(258 * 0.1) + round(16 * 0.1)
    assert single_turn.category_of("live_parallel_multiple_3-2-1") == "live_parallel_multiple"
    assert single_turn.category_of("parallel_multiple_7") == "parallel_multiple"
    assert task_of_id("simple_python_3").name == "single_turn"
    assert task_of_id("multi_turn_base_3").name == "multi_turn"
    with pytest.raises(ValueError, match="single-turn entry id"):
        single_turn.category_of("simple_java_3")


@pytest.mark.parametrize("data,needle", [
    ({"task": "both"}, "task"),
    ({"task": "single_turn", "categories": ["base"]}, "categories"),
    ({"task": "multi_turn", "categories": ["simple_python"]}, "categories"),
])
def test_bad_task_or_categories_fail_naming_the_field(data, needle):
    with pytest.raises(ConfigError, match=needle):
        config_from_params(PrepareDataConfig, "prepare_data", **data)


def test_entries_round_trip_and_dispatch():
    entries, _ = prepare(config_from_params(PrepareDataConfig, "prepare_data", task="single_turn", categories=("live_simple",)))
    e = next(x for x in entries if x.question[0]["role"] == "system")
    back = entry_from_json(json.loads(json.dumps(e.to_json())))
    assert back == e and task_of(back) is TASKS["single_turn"]
    mt = TASKS["multi_turn"].load_entries(["base"])[0]
    assert entry_from_json(json.loads(json.dumps(mt.to_json()))) == mt  # rows without `task` are multi-turn
    with pytest.raises(ValueError, match="2 tasks"):
        task_of_entries([e, mt])


def test_prompt_is_bfcl_prompting_mode():
    """BFCL's system prompt with the hinted docs; a live entry's own system message appended to it; the
    reward goal on the first user message; `short` keeps the format rule and the docs only."""
    entries = single_turn.load_entries(["live_simple"])
    e = next(x for x in entries if x.question[0]["role"] == "system")
    msgs = initial_messages(e, PromptConfig("paper", "official", "bfcl").protocol_config(20), "<|high_reward|>")
    assert [m["role"] for m in msgs] == [m["role"] for m in e.question]
    assert msgs[0]["content"].startswith("You are an expert in composing functions.")
    assert msgs[0]["content"].endswith("\n\n" + e.question[0]["content"])
    assert json.dumps(single_turn.hinted(e.functions), indent=4) in msgs[0]["content"]
    assert msgs[1]["content"] == e.question[1]["content"] + "\n\n[Reward Goal: <|high_reward|>]"
    short = initial_messages(e, PromptConfig("paper", "compact", "short").protocol_config(20))[0]["content"]
    assert short.startswith("You should only return the function calls") and "# Function: " in short
    assert "Note that the provided function is in Python 3 syntax." in short


def test_python_docs_match_bfcl_renderer():
    from bfcl_eval.model_handler.utils import _generate_function_doc_python

    for e in single_turn.load_entries(single_turn.CATEGORIES)[::7]:
        docs = single_turn.hinted(e.functions)
        assert single_turn.python_docs(docs) == _generate_function_doc_python(docs), e.id


def test_expert_takes_one_accepted_value_and_omits_optional_only():
    e = single_turn.load_entries(["simple_python"])[0]  # base [10], height [5], unit ["units", ""]
    assert expert_answer(e) == [{"calculate_triangle_area": {"base": 10, "height": 5, "unit": "units"}}]
    assert expert_calls(e) == ["calculate_triangle_area(base=10, height=5, unit='units')"]
    for e in single_turn.load_entries(single_turn.CATEGORIES):
        for gold, (call,) in zip(e.possible_answer, (c.items() for c in expert_answer(e))):
            (name, accepted), = gold.items()
            assert call[0] == name
            assert set(call[1]) == {p for p, vs in accepted.items() if any(v not in ("", None) for v in vs)}


@pytest.mark.parametrize("kind", PERTURBATIONS)
def test_every_near_miss_kind_applies_and_changes_the_script(kind):
    entries = single_turn.load_entries(single_turn.DEFAULT_CATEGORIES)[::25]
    made = 0
    for e in entries:
        p = perturb(e, kind, random.Random(f"0:{e.id}:{kind}"))
        if p is None:
            continue
        made += 1
        assert p.kind == kind and len(p.turns) == 1 and p.turns != (tuple(expert_calls(e)),) and p.detail
        assert p == perturb(e, kind, random.Random(f"0:{e.id}:{kind}"))  # seeded
    assert made >= len(entries) // 2


def test_near_miss_kinds_change_what_they_say():
    e = single_turn.load_entries(["parallel"])[0]
    n = len(expert_answer(e))
    assert len(perturb(e, "dropped_call", random.Random(0)).turns[0]) == n - 1
    assert len(perturb(e, "extra_call", random.Random(0)).turns[0]) == n + 1
    missing = perturb(e, "missing_param", random.Random(0))
    assert sum(c.count("=") for c in missing.turns[0]) == sum(c.count("=") for c in expert_calls(e)) - 1
    with pytest.raises(ValueError, match="unknown single-turn perturbation"):
        perturb(e, "wrong_turn", random.Random(0))
