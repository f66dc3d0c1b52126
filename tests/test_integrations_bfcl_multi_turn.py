"""BFCL for TRL users (`rcgrpo_tasks/integrations/`), multi-turn: the environments' tools against BFCL's docs and
the pipeline's episodes and scorer, `reset` and `done`, the dataset, and one RC-GRPO step through TRL's own tool
loop (tiny random model, real SmolLM2 tokenizer with the shipped template)."""

from __future__ import annotations

import copy
import json
import os

import pytest
from bfcl_trl import grpo_args, keyword_call, replay, sample, tools_of

from rcgrpo.goal import DEFAULT_LEVELS, format_goal
from rcgrpo_tasks.env.multi_turn.calls import format_calls, parse_call_string
from rcgrpo_tasks.env.multi_turn.entries import CATEGORIES as MT_CATEGORIES
from rcgrpo_tasks.env.multi_turn.entries import FUNC_DOC_FILES, entries_by_id
from rcgrpo_tasks.env.multi_turn.entries import load_entries as load_multi_turn
from rcgrpo_tasks.env.multi_turn.environment import public_methods
from rcgrpo_tasks.env.multi_turn.episode import DONE_DOC, Episode, merged_user_message
from rcgrpo_tasks.env.multi_turn.scoring import score_entry
from rcgrpo_tasks.env.prompt import PromptConfig
from rcgrpo_tasks.env.single_turn.entries import load_entries as load_single_turn
from rcgrpo_tasks.integrations import (
    install_tool_chat_template,
    multi_turn_dataset,
    multi_turn_entries,
    multi_turn_environments,
)
from rcgrpo_tasks.integrations.bfcl_multi_turn import AFTER_DONE, paper_docs, prompt_messages

LOW, HIGH = DEFAULT_LEVELS
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


def test_tool_schemas_are_the_bfcl_docs():
    """Every BFCL class: one tool per documented function, its schema (transformers' `get_json_schema`, what TRL
    renders) carrying the doc's name, description, parameters, types and required list; an environment holds its
    entry's classes' functions and `done`, nothing else."""
    from transformers.utils import get_json_schema

    json_types = {"string": "string", "integer": "integer", "float": "number", "number": "number",
                  "boolean": "boolean", "array": "array", "dict": "object", "tuple": "array", "any": None}
    entries = load_multi_turn(MT_CATEGORIES)
    envs = multi_turn_environments(entries)
    assert len(envs) == len({e.involved_classes for e in entries})
    for cls_name in FUNC_DOC_FILES:
        entry = next(e for e in entries if e.involved_classes == (cls_name,) or cls_name in e.involved_classes)
        env = envs["bfcl_" + "_".join(entry.involved_classes)]()
        docs = {d["name"]: d for d in paper_docs(entry)}
        tools = tools_of(env)
        assert set(tools) == set(docs) | {"done"}
        assert set(docs) == {m for c in entry.involved_classes for m in public_methods(c)}
        for name, doc in docs.items():
            schema = get_json_schema(tools[name])["function"]
            props, params = schema["parameters"]["properties"], doc["parameters"]
            assert schema["name"] == name and schema["description"] == " ".join(doc["description"].split())
            assert list(props) == list(params["properties"])
            assert sorted(schema["parameters"].get("required", [])) == sorted(params["required"])
            for p, spec in params["properties"].items():
                assert props[p].get("type") == json_types[spec["type"]], (name, p)
                assert props[p]["description"].startswith(" ".join(spec["description"].split()))
    done = get_json_schema(tools_of(env)["done"])["function"]
    assert done == {"name": "done", "description": DONE_DOC["description"],
                    "parameters": {"type": "object", "properties": {}}}


def test_tools_execute_as_the_pipelines_episodes():
    """Through the tools, an entry's gold script makes the pipeline's observations and earns the paper reward
    (1.0); the script without its last call earns what the pipeline's scorer gives it (0.0)."""
    entries = sample(load_multi_turn(MT_CATEGORIES), per_category=10, seed=1)
    envs = multi_turn_environments(entries)
    for entry in entries:
        gold = [c for turn in entry.ground_truth for c in turn]
        env = envs["bfcl_" + "_".join(entry.involved_classes)]()
        assert env.reset(entry_id=entry.id) is None
        observations = replay(env, entry, gold)
        episode = Episode(entry, PromptConfig(protocol="paper", doc_style="compact", system_prompt="bfcl").protocol_config(len(gold) + 1))
        expected = [m["content"] for c in gold for m in episode.step(format_calls([parse_call_string(c)]))]
        assert observations == expected, entry.id
        assert env.get_reward() == 1.0 == score_entry(entry, env.result).paper_reward
        env.reset(entry_id=entry.id)
        replay(env, entry, gold[:-1])
        assert env.get_reward() == score_entry(entry, env.result).paper_reward == 0.0, entry.id


def test_reset_gives_the_goal_and_fresh_isolated_state():
    """`reset` returns the goal of the row's token (None without) and starts from the entry's initial state;
    two environments of one entry share nothing."""
    entry = entries_by_id()["multi_turn_base_100"]
    cls = multi_turn_environments([entry], goal_template=" <goal {token}>")["bfcl_TradingBot"]
    a, b = cls(), cls()
    assert a.reset(entry_id=entry.id, reward_token=HIGH, prompt=[], category="base") == f" <goal {HIGH}>"
    assert b.reset(entry_id=entry.id) is None
    assert multi_turn_environments([entry])["bfcl_TradingBot"]().reset(entry.id, LOW) == format_goal(LOW)
    before = copy.deepcopy(b.bfcl_environment.state())
    replay(a, entry, [c for turn in entry.ground_truth for c in turn])
    assert a.bfcl_environment.state() != before and b.bfcl_environment.state() == before
    assert a.bfcl_environment.instances["TradingBot"] is not b.bfcl_environment.instances["TradingBot"]
    a.reset(entry_id=entry.id)
    assert a.result == [[]] and a.bfcl_environment.state() == before


def test_done_ends_the_episode():
    """After `done()` no call is executed or recorded, as the paper protocol's episode ends at done()."""
    entry = entries_by_id()["multi_turn_base_100"]
    env = multi_turn_environments([entry])["bfcl_TradingBot"]()
    env.reset(entry_id=entry.id)
    gold = [c for turn in entry.ground_truth for c in turn]
    replay(env, entry, gold[:-1])
    env.done()
    before = copy.deepcopy(env.bfcl_environment.state())
    assert replay(env, entry, gold[-1:]) == [AFTER_DONE]
    assert env.bfcl_environment.state() == before and len(env.result[0]) == len(gold) - 1
    assert env.get_reward() == 0.0


def test_environment_errors_name_what_is_wrong():
    base = load_multi_turn(("base",))
    env = multi_turn_environments(base[:1])["bfcl_" + "_".join(base[0].involved_classes)]()
    with pytest.raises(RuntimeError, match="before reset"):
        env.get_reward()
    other = next(e for e in base if e.involved_classes != base[0].involved_classes)
    with pytest.raises(ValueError, match=repr(other.id)):
        env.reset(entry_id=other.id)
    with pytest.raises(ValueError, match="not a multi-turn entry"):
        multi_turn_environments(load_single_turn(("simple_python",))[:1])


def test_multi_turn_dataset_rows():
    """A row: the system message and the paper protocol's merged user message (no goal), its entry's environment,
    which `multi_turn_environments` of the same entries provides."""
    ds = multi_turn_dataset(categories=["miss_func"])
    entries = multi_turn_entries(categories=["miss_func"])
    envs = multi_turn_environments(entries)
    assert ds["entry_id"] == [e.id for e in entries] and set(ds["environment"]) == set(envs)
    for row, e in zip(ds, entries):
        assert row["prompt"] == prompt_messages(e) and row["prompt"][-1]["content"] == merged_user_message(e)
        assert e.id in envs[row["environment"]].entries


# ---------------------------------------------------------------------------------------------- TRL's tool loop

STEP_ENTRIES = ("multi_turn_base_100", "multi_turn_base_50")
"""Two entries of two environments (TradingBot; VehicleControlAPI) with the shortest prompts and gold scripts."""


def environment_trainer(tiny_model_dir, tmp_path, max_completion_length=320):
    """RCGRPOTrainer on the two entries: the goal from `reset()`, the BFCL environments as TRL's dict factory,
    SmolLM2's tokenizer with the shipped template; captures each scored generation batch."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rcgrpo import RCGRPOConfig, RCGRPOTrainer, add_reward_tokens

    entries = [entries_by_id()[i] for i in STEP_ENTRIES]
    ds = multi_turn_dataset(categories=["base"], system_prompt_style="short")
    ds = ds.filter(lambda row: row["entry_id"] in STEP_ENTRIES)
    tok = install_tool_chat_template(AutoTokenizer.from_pretrained(tiny_model_dir))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    add_reward_tokens(model, tok)
    args = grpo_args(RCGRPOConfig, tmp_path, reward_goal_place="external",
                     max_completion_length=max_completion_length, token_draw="stratified")
    trainer = RCGRPOTrainer(model=model, args=args, train_dataset=ds,
                            processing_class=tok,
                            environment_factory=multi_turn_environments(entries, short_descriptions=True))
    outputs = []
    original = trainer._generate_and_score_completions
    trainer._generate_and_score_completions = lambda inputs: outputs.append(original(inputs)) or outputs[-1]
    return trainer, tok, entries, outputs


def prompts_of(tok, output) -> list[str]:
    return [tok.decode(ids[mask.bool()]) for ids, mask in zip(output["prompt_ids"], output["prompt_mask"])]


def test_one_rcgrpo_step_through_trls_tool_loop(tiny_model_dir, tmp_path):
    """One RC-GRPO step on the CPU (tiny model, shipped template) through TRL's own tool loop (parse, call, append
    results, generate again) on the BFCL environments, the model's sampling replaced by a script: under the high
    token each rollout emits its entry's gold calls then done(), under the low token the same without the last
    gold call. Each prompt ends in its token's goal (what `reset()` returned, appended by TRL to the merged user
    message) and lists its own entry's tools only; the environment's paper reward is 1 / 0 by token, and
    RC-GRPO's metrics see it."""
    trainer, tok, entries, outputs = environment_trainer(tiny_model_dir, tmp_path)

    def script(entry, token) -> str:
        gold = [c for turn in entry.ground_truth for c in turn]
        calls = [keyword_call(entry, c) for c in (gold if token == HIGH else gold[:-1])] + [("done", {})]
        message = {"role": "assistant", "content": "",
                   "tool_calls": [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]}
        user = [{"role": "user", "content": "x"}]
        prompt = tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
        return tok.apply_chat_template([*user, message], tokenize=False)[len(prompt):].rstrip("\n")

    def generate(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        out = []
        for ids in prompt_ids:
            text = tok.decode(ids)
            if "<tool_response>" in text:
                out.append(tok.encode("Finished.<|im_end|>", add_special_tokens=False))
                continue
            entry, token = next((e, t) for e in entries for t in (LOW, HIGH)
                                if merged_user_message(e) + format_goal(t) in text)
            out.append(tok.encode(script(entry, token), add_special_tokens=False))
        return out, None

    trainer._generate_single_turn = generate
    trainer.train()
    assert trainer.state.global_step == 1
    generation = trainer.last_generation
    assert sorted(generation.reward_tokens) == sorted([LOW, HIGH] * 2)
    tools = {e.id: set(tools_of(multi_turn_environments([e])["bfcl_" + "_".join(e.involved_classes)]()))
             for e in entries}
    for text, token in zip(prompts_of(tok, outputs[0]), generation.reward_tokens):
        entry = next(e for e in entries if merged_user_message(e) in text)
        assert (merged_user_message(entry) + format_goal(token) + "<|im_end|>") in text
        listed = text.split("<tools>\n")[1].split("\n</tools>")[0].splitlines()
        assert {json.loads(line)["function"]["name"] for line in listed} == tools[entry.id]
    assert generation.rewards == tuple(1.0 if t == HIGH else 0.0 for t in generation.reward_tokens)
    logged = trainer.state.log_history[0]
    assert logged["tools/call_frequency"] > 0 and logged["tools/failure_frequency"] == 0
    assert logged["rc/success_high"] == 1.0 and logged["rc/success_low"] == 0.0
    for env, token in zip(trainer.environments, generation.reward_tokens):
        gold = [c for turn in env.entry.ground_truth for c in turn]
        assert len(env.result[0]) == len(gold) - (token == LOW)


def test_plain_grpo_trainer_takes_the_environments_only_with_the_shipped_template(tiny_model_dir, tmp_path):
    """`trl.GRPOTrainer(environment_factory=...)` refuses SmolLM2's own template and starts with the shipped one,
    one reward column per environment (`get_reward`), each environment's tools its entry's."""
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer

    entries = [entries_by_id()[i] for i in STEP_ENTRIES]
    ds = multi_turn_dataset(categories=["base"]).filter(lambda row: row["entry_id"] in STEP_ENTRIES)
    envs = multi_turn_environments(entries)

    def build(tok):
        return trl.GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(tiny_model_dir), train_dataset=ds,
                               args=grpo_args(trl.GRPOConfig, tmp_path), processing_class=tok, environment_factory=envs)

    with pytest.raises(ValueError, match="does not support tool calling"):
        build(AutoTokenizer.from_pretrained(tiny_model_dir))
    trainer = build(install_tool_chat_template(AutoTokenizer.from_pretrained(tiny_model_dir)))
    assert trainer.reward_func_names == list(envs)
    for name, cls in envs.items():
        assert {t.__name__ for t in trainer._env_tools[name]} == set(tools_of(cls()))
