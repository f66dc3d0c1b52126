"""BFCL for TRL users (`rcgrpo_tasks/integrations/`), single-turn and the template: the dataset and reward against
the pipeline's own prompts and scorer, one step of TRL's and RC-GRPO's trainers on them (tiny random model), and
the tool-calling template for SmolLM2 against SmolLM2's own and what TRL needs (real SmolLM2 tokenizer).
Multi-turn: tests/test_integrations_bfcl_multi_turn.py."""

from __future__ import annotations

import builtins
import copy
import json
import os
import random

import pytest
from bfcl_trl import calls_text, grpo_args, keyword_call, sample, tools_of

from rcgrpo.goal import DEFAULT_LEVELS, format_goal, place_goal
from rcgrpo_tasks.env.multi_turn.entries import entries_by_id
from rcgrpo_tasks.env.multi_turn.entries import load_entries as load_multi_turn
from rcgrpo_tasks.env.prompt import PromptConfig
from rcgrpo_tasks.env.rewards import REWARDS, reward_value
from rcgrpo_tasks.env.single_turn.entries import CATEGORIES as ST_CATEGORIES
from rcgrpo_tasks.env.single_turn.entries import load_entries as load_single_turn
from rcgrpo_tasks.env.single_turn.episode import initial_messages, score_text
from rcgrpo_tasks.env.single_turn.task import TASK as SINGLE_TURN
from rcgrpo_tasks.integrations import (
    SMOLLM2_TOOL_CHAT_TEMPLATE,
    install_tool_chat_template,
    multi_turn_environments,
    single_turn_dataset,
    single_turn_reward,
)
from rcgrpo_tasks.integrations.bfcl_single_turn import protocol_of
from rcgrpo_tasks.integrations.chat_template import SMOLLM2_DEFAULT_SYSTEM
from rcgrpo_tasks.ops.inputs import InputError
from rcgrpo_tasks.ops.outputs import write_json, write_jsonl

LOW, HIGH = DEFAULT_LEVELS
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


# ---------------------------------------------------------------------------------------------- single-turn


def test_single_turn_dataset_rows_are_the_tasks_initial_messages():
    """Every row's prompt is the pipeline's initial messages of its entry (no reward goal), in entry order."""
    cfg = PromptConfig(protocol="paper", doc_style="json", system_prompt="short")
    ds = single_turn_dataset(categories=["simple_python", "live_multiple"], prompt=cfg)
    entries = load_single_turn(("simple_python", "live_multiple"))
    assert ds.column_names == ["prompt", "entry_id", "category"]
    assert ds["entry_id"] == [e.id for e in entries]
    for row, e in zip(ds, entries):
        assert row["prompt"] == initial_messages(e, cfg.protocol_config(1)) and row["category"] == e.category
        assert "Reward Goal" not in json.dumps(row["prompt"])
    default = single_turn_dataset(categories=["parallel"])
    assert default[0]["prompt"] == initial_messages(load_single_turn(("parallel",))[0], protocol_of(None))
    for row, e in zip(ds.select(range(3)), entries):  # RCGRPOTrainer's default goal place is the pipeline's
        assert place_goal(row["prompt"], format_goal(HIGH)) == initial_messages(e, cfg.protocol_config(1), HIGH)


def test_single_turn_dataset_reads_a_prepared_split(tmp_path):
    """A prepare_data split selects its side (entries in file order); bad selections are clear errors."""
    entries = load_single_turn(("simple_python",))[:6] + load_single_turn(("multiple",))[:6]
    write_jsonl(tmp_path / "entries.jsonl", (e.to_json() for e in entries))
    split = {"train": [e.id for e in entries[:5]], "rl": [e.id for e in entries[5:9]], "dev": [],
             "test": [e.id for e in entries[9:]]}
    write_json(tmp_path / "split.json", split)
    ds = single_turn_dataset(categories=None, side="rl", entries_path=tmp_path / "entries.jsonl",
                             split_path=tmp_path / "split.json")
    assert ds["entry_id"] == split["rl"]
    ds = single_turn_dataset(categories=["multiple"], entries_path=tmp_path / "entries.jsonl")
    assert ds["entry_id"] == [e.id for e in entries if e.category == "multiple"]
    with pytest.raises(ValueError, match="side and split_path go together"):
        single_turn_dataset(side="train")
    with pytest.raises(ValueError, match="non-empty subset"):
        single_turn_dataset(categories=["base"])
    write_jsonl(tmp_path / "mt.jsonl", (e.to_json() for e in load_multi_turn(("base",))[:2]))
    with pytest.raises(InputError, match="mt.jsonl"):
        single_turn_dataset(categories=None, entries_path=tmp_path / "mt.jsonl")


def test_single_turn_reward_is_the_pipeline_scorer():
    """On experts and near misses of every category, each reward equals the pipeline's scorer on the same
    text: 1.0 for an expert BFCL accepts, 0.0 for a near miss it rejects; conversational and plain completions
    score alike; the function is named after its reward (TRL's logs)."""
    entries = sample(load_single_turn(ST_CATEGORIES), per_category=6)
    texts, ids = [], []
    for e in entries:
        texts.append(calls_text(SINGLE_TURN.expert_script(e)[0]))
        ids.append(e.id)
        for kind in SINGLE_TURN.perturbations:
            miss = SINGLE_TURN.perturb(e, kind, random.Random(f"{e.id}:{kind}"))
            if miss is not None:
                texts.append(calls_text(miss.turns[0]))
                ids.append(e.id)
    pool = {e.id: e for e in entries}
    scores = [score_text(pool[i], t) for i, t in zip(ids, texts)]
    for reward in REWARDS:
        f = single_turn_reward(reward)
        assert f.__name__ == reward
        got = f(completions=[[{"role": "assistant", "content": t}] for t in texts], entry_id=ids, prompts=None)
        assert got == [reward_value(s, reward) for s in scores]
        assert f(completions=texts, entry_id=ids) == got
    paper = single_turn_reward("paper_reward", entries=entries)(completions=texts, entry_id=ids)
    experts = {i for i, t in zip(ids, texts) if t == calls_text(SINGLE_TURN.expert_script(pool[i])[0])}
    assert sum(r == 1.0 for r, t, i in zip(paper, texts, ids) if i in experts) >= 0.9 * len(entries)
    assert sum(r == 0.0 for r in paper) >= 2 * len(entries)  # most near misses fail, as they should


def test_single_turn_reward_never_runs_model_text(tmp_path, monkeypatch):
    """Code in a completion is data: nothing is evaluated or executed, and it scores 0."""
    marker = tmp_path / "ran"
    payloads = [f"[__import__('os').system('touch {marker}')]", f"__import__('pathlib').Path('{marker}').touch()",
                f"[calculate_triangle_area(base=open('{marker}', 'w'), height=5)]",
                "[calculate_triangle_area(base=(lambda: 10)(), height=5)]", "[eval('1+1')]", "exec('x=1')"]

    def refuse(*_a, **_k):
        raise AssertionError("model text reached eval/exec")

    monkeypatch.setattr(builtins, "eval", refuse)
    monkeypatch.setattr(builtins, "exec", refuse)
    entry = load_single_turn(("simple_python",))[0]
    rewards = single_turn_reward("paper_reward")(completions=payloads, entry_id=[entry.id] * len(payloads))
    assert rewards == [0.0] * len(payloads) and not marker.exists()


def test_single_turn_reward_errors_name_the_entry():
    f = single_turn_reward()
    with pytest.raises(ValueError, match="'simple_python_99999'"):
        f(completions=["[]"], entry_id=["simple_python_99999"])
    with pytest.raises(TypeError, match="simple_python_0"):
        f(completions=[[{"role": "assistant", "content": None}]], entry_id=["simple_python_0"])
    with pytest.raises(ValueError, match="unknown reward"):
        single_turn_reward("accuracy")


@pytest.mark.parametrize("trainer_name", ["RCGRPOTrainer", "GRPOTrainer"])
def test_one_step_on_single_turn(trainer_name, tiny_model_dir, tmp_path):
    """The dataset and reward as any TRL user passes them: one optimizer step of each trainer on the CPU."""
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import rcgrpo

    cls = getattr(rcgrpo, trainer_name, None) or getattr(trl, trainer_name)
    config = rcgrpo.RCGRPOConfig if cls is rcgrpo.RCGRPOTrainer else trl.GRPOConfig
    short = PromptConfig(protocol="official", doc_style="compact", system_prompt="short")
    ds = single_turn_dataset(categories=["simple_python"], prompt=short).select(range(2))
    model, tok = AutoModelForCausalLM.from_pretrained(tiny_model_dir), AutoTokenizer.from_pretrained(tiny_model_dir)
    if cls is rcgrpo.RCGRPOTrainer:
        rcgrpo.add_reward_tokens(model, tok)  # RC-GRPO starts from a model that has them (an RCTP model)
    trainer = cls(model=model, reward_funcs=[single_turn_reward("paper_reward"), single_turn_reward("partial_credit")],
                  args=grpo_args(config, tmp_path), train_dataset=ds, processing_class=tok)
    trainer.train()
    logged = trainer.state.log_history[0]
    assert trainer.state.global_step == 1
    assert {"rewards/paper_reward/mean", "rewards/partial_credit/mean"} <= set(logged)


# ---------------------------------------------------------------------------------------------- the template


@pytest.fixture(scope="module")
def smollm2_tok(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


def test_tool_template_renders_plain_chats_as_smollm2(smollm2_tok):
    """The shipped template is Qwen2.5's with SmolLM2's system line, and without tools it renders every
    system / user / assistant chat exactly as SmolLM2's own template (prompt-mode prompts do not change)."""
    from trl.chat_template_utils import qwen2_5_chat_template

    qwen_line = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    assert SMOLLM2_TOOL_CHAT_TEMPLATE == qwen2_5_chat_template.replace(qwen_line, SMOLLM2_DEFAULT_SYSTEM)
    tooled = install_tool_chat_template(copy.deepcopy(smollm2_tok))
    chats = [[{"role": "user", "content": "hi"}],
             [{"role": "system", "content": "S"}, {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
              {"role": "user", "content": "q2"}],
             [{"role": "user", "content": "q"}, {"role": "assistant", "content": "[f(a=1)]"}],
             *(row["prompt"] for row in single_turn_dataset(categories=["live_simple"]).select(range(3)))]
    for chat in chats:
        for gen in (False, True):
            assert tooled.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen) == \
                smollm2_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)


def test_tool_template_is_what_trl_needs(smollm2_tok, tmp_path):
    """SmolLM2's template cannot express tool calls (TRL refuses it); the shipped one can, is prefix-preserving,
    survives `save_pretrained`, and TRL's parser reads back the calls it renders, arguments typed by the tool's
    schema."""
    from transformers import AutoTokenizer
    from trl.chat_template_utils import is_chat_template_prefix_preserving, parse_response, supports_tool_calling

    assert not supports_tool_calling(smollm2_tok)
    tok = install_tool_chat_template(copy.deepcopy(smollm2_tok))
    assert supports_tool_calling(tok) and is_chat_template_prefix_preserving(tok)
    tok.save_pretrained(tmp_path)
    saved = AutoTokenizer.from_pretrained(tmp_path)
    assert (saved.chat_template, saved.response_template) == (tok.chat_template, tok.response_template)
    entry = entries_by_id()["multi_turn_base_100"]
    env = multi_turn_environments([entry])["bfcl_TradingBot"]()
    tools = list(tools_of(env).values())
    calls = [keyword_call(entry, c) for turn in entry.ground_truth for c in turn] + [("done", {})]
    user = [{"role": "user", "content": "go"}]
    message = {"role": "assistant", "content": "",
               "tool_calls": [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]}
    prompt = tok.apply_chat_template(user, tools=tools, add_generation_prompt=True, tokenize=False)
    full = tok.apply_chat_template([*user, message], tools=tools, tokenize=False)
    assert full.startswith(prompt)
    ids = tok.encode(full[len(prompt):].rstrip("\n"), add_special_tokens=False)
    parsed = parse_response(tok, ids, prefix=tok.encode(prompt, add_special_tokens=False), tools=tools)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in parsed["tool_calls"]] == calls


def test_tool_template_refuses_a_tokenizer_that_is_not_chatml(smollm2_tok):
    tok = copy.deepcopy(smollm2_tok)
    tok.eos_token = "<|endoftext|>"
    with pytest.raises(ValueError, match="EOS"):
        install_tool_chat_template(tok)
