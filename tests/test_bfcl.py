"""BFCL v4 multi-turn data: 4 x 200 entries with ground truth, docs, miss_func hold-backs, renderings."""

import json

import pytest
from helpers import get_entry

from rcgrpo_tasks.env.multi_turn import entries as multi_turn


def test_four_categories_of_200_with_ground_truth_per_turn():
    for cat in multi_turn.CATEGORIES:
        entries = multi_turn.load_entries([cat])
        assert len(entries) == 200
        for e in entries:
            assert len(e.turns) == len(e.ground_truth) and e.involved_classes and e.category == cat


def test_miss_func_docs_are_held_back_until_their_turn():
    e = get_entry("multi_turn_miss_func_0")
    visible, held = multi_turn.entry_docs(e)
    assert held == {3: [d for d in held[3] if d["name"] == "sort"]} and held[3]
    assert "sort" not in {d["name"] for d in visible}
    assert e.turns[3] == ()  # the held-back turn has no user message: the docs arrive instead


def test_compact_rendering_one_line_per_function_with_defaults():
    e = get_entry("multi_turn_base_0")
    visible, _ = multi_turn.entry_docs(e)
    text = multi_turn.render_docs(visible, "compact")
    lines = text.splitlines()
    assert len(lines) == len(visible)
    cd = next(line for line in lines if line.startswith("cd("))
    assert cd.startswith("cd(folder: str) -> Change the current working directory")
    ls = next(line for line in lines if line.startswith("ls("))
    assert "a: bool = False" in ls
    official = multi_turn.render_docs(visible, "json")
    assert [json.loads(line) for line in official.splitlines()] == visible
    assert len(text) < len(official) / 4


def test_compact_docs_fit_a_small_context(tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    lengths = sorted(len(tok(multi_turn.render_docs(multi_turn.entry_docs(e)[0], "compact")).input_ids)
                     for e in multi_turn.load_entries(["base"])[:40])
    assert lengths[len(lengths) // 2] < 1500 and lengths[-1] < 4000


@pytest.mark.parametrize("bad", ["multi_turn_base", "simple_3", "multi_turn_other_3"])
def test_bad_ids_are_rejected(bad):
    with pytest.raises((KeyError, ValueError)):
        multi_turn.category_of(bad) if "other" in bad else get_entry(bad)
