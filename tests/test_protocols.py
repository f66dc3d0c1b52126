"""Protocols driven by a scripted fake policy: fixed calls, malformed output, prose, never-ending calls.

No model: `ScriptedBackend` answers from a script; the real SmolLM2 tokenizer renders the tokens.
"""

from __future__ import annotations

import json

import pytest
from helpers import config_from_params, get_entry

from rcgrpo.goal import format_goal
from rcgrpo_tasks.engine.backend import SamplingParams, ScriptedBackend
from rcgrpo_tasks.engine.rollout import replay_calls, run_episodes, run_group
from rcgrpo_tasks.env.multi_turn import entries as multi_turn
from rcgrpo_tasks.env.multi_turn.calls import parse_call_string
from rcgrpo_tasks.env.multi_turn.episode import PAPER_INSTRUCTION, Episode, initial_messages, system_prompt
from rcgrpo_tasks.env.prompt import BFCL_CLASSIC, BFCL_MAX_STEPS_PER_TURN, PromptConfig

OFFICIAL = PromptConfig("official", "compact", "bfcl").protocol_config(20)
PAPER = PromptConfig("paper", "compact", "bfcl").protocol_config(6)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=512)


def _calls(turn):
    return "[" + ", ".join(turn) + "]"


def _run(tok, entry, cfg, script, reward_token=None):
    backend = ScriptedBackend(tok, [script])
    return run_episodes(backend, [Episode(entry, cfg, reward_token)], GREEDY)[0]


def test_bfcl_prompt_text_matches_installed_bfcl_eval():
    from bfcl_eval.constants import default_prompts as dp

    for key, text in BFCL_CLASSIC.items():
        assert dp.PROMPT_STYLE_TEMPLATES["classic"][key] == text
    assert dp.MAXIMUM_STEP_LIMIT == BFCL_MAX_STEPS_PER_TURN
    assert dp.DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_PROMPTING.format(functions="X") == \
        "X\n" + multi_turn.ADDITIONAL_FUNCTION_PROMPT


def test_official_system_prompt_is_bfcl_default():
    from bfcl_eval.constants import default_prompts as dp

    entry = get_entry("multi_turn_base_0")
    docs = multi_turn.entry_docs(entry)[0]
    got = system_prompt(docs, PromptConfig("official", "official", "bfcl").protocol_config(20))
    t = dp.PROMPT_STYLE_TEMPLATES["classic"]
    want = dp.PROMPT_TEMPLATE_MAPPING["plaintext"].format(
        persona=t["persona"], task=t["task"],
        tool_call_format=t["tool_call_no_tag"].format(output_format=dp.OUTPUT_FORMAT_MAPPING["python"],
                                                      param_types=dp.PARAM_TYPE_MAPPING["python"]),
        multiturn_behavior=t["multiturn_behavior"],
        available_tools=t["available_tools"].format(format="json", functions=json.dumps(docs, indent=4)))
    assert got == want


def test_gold_calls_score_valid_official(tok):
    entry = get_entry("multi_turn_base_0")
    traj = replay_calls(entry, OFFICIAL, entry.ground_truth, tok)
    assert traj.termination == "completed"
    assert traj.score["valid"] and traj.score["paper_reward"] == 1.0 and traj.score["partial_credit"] == 1.0
    assert [[c for s in t for c in s] for t in traj.result] == \
        [[parse_call_string(c).to_string() for c in t] for t in entry.ground_truth]
    tool_msgs = [m for m in traj.messages if m["role"] == "tool"]
    assert len(tool_msgs) == sum(len(t) for t in entry.ground_truth)
    assert all(m["name"] for m in tool_msgs)


def test_wrong_malformed_and_prose_official(tok):
    entry = get_entry("multi_turn_base_0")
    gt = entry.ground_truth
    script = [_calls(gt[0]), "done with that",            # turn 0: gold calls, then prose ends the turn
              "[cd(folder='temp'), grep(file_name=x)]",      # turn 1: fails to decode -> nothing runs
              _calls(gt[2]), "ok",                           # turn 2
              _calls(gt[3]), "```\nthat's all\n```"]         # turn 3: prose in a fence is still prose
    traj = _run(tok, entry, OFFICIAL, script)
    assert traj.termination == "completed" and traj.n_steps == 7
    assert len(traj.result) == 4 and traj.result[1] == []  # the malformed output executed nothing
    assert traj.score["valid"] is False
    assert traj.score["error_type"] == "multi_turn:empty_turn_model_response"
    assert traj.score["turn_passed"][:2] == [True, False] and 0 < traj.score["partial_credit"] < 1
    assert traj.score["paper_reward"] == 0.0


def test_never_ending_calls_force_terminate_official(tok):
    entry = get_entry("multi_turn_base_0")
    backend = ScriptedBackend(tok, lambda key, step, ids: "[pwd()]")
    traj = run_group(backend, entry, 2, OFFICIAL, GREEDY)[1]
    assert traj.termination == "step_limit"
    assert traj.n_steps == BFCL_MAX_STEPS_PER_TURN + 1  # bfcl: quit once count > MAXIMUM_STEP_LIMIT
    assert len(traj.result) == 1 and len(traj.result[0]) == BFCL_MAX_STEPS_PER_TURN + 1
    assert traj.score["error_type"] == "multi_turn:force_terminated"


def test_miss_func_doc_injection_official(tok):
    entry = get_entry("multi_turn_miss_func_0")
    (held_turn, names), = entry.missed_function.items()
    system = initial_messages(entry, OFFICIAL)[0]["content"]
    assert all(f"{n}(" not in system for n in names)  # withheld from the start
    traj = replay_calls(entry, OFFICIAL, entry.ground_truth, tok)
    users = [m["content"] for m in traj.messages if m["role"] == "user"]
    assert len(users) == len(entry.turns)
    injected = users[held_turn]
    assert injected.endswith("\n" + multi_turn.ADDITIONAL_FUNCTION_PROMPT)
    assert all(injected.startswith(f"{n}(") or f"\n{n}(" in injected for n in names)
    assert traj.score["valid"]
    # official doc style injects BFCL's exact text: str() of the doc list
    official = PromptConfig("official", "official", "bfcl").protocol_config(20)
    traj = replay_calls(entry, official, entry.ground_truth, tok)
    held = multi_turn.entry_docs(entry)[1][held_turn]
    assert [m for m in traj.messages if m["role"] == "user"][held_turn]["content"] == \
        f"{held}\n{multi_turn.ADDITIONAL_FUNCTION_PROMPT}"


def test_reward_token_slot_both_protocols():
    entry = get_entry("multi_turn_base_3")
    for cfg in (OFFICIAL, PAPER):
        plain = initial_messages(entry, cfg)
        high = initial_messages(entry, cfg, "<|high_reward|>")
        assert high[1]["content"] == plain[1]["content"] + "\n\n[Reward Goal: <|high_reward|>]"
        assert high[0] == plain[0]
    assert format_goal(None) == ""


def test_paper_merged_message_and_done(tok):
    entry = get_entry("multi_turn_miss_func_0")
    msgs = initial_messages(entry, PAPER)
    user = msgs[1]["content"]
    assert user.startswith("Step 1: Move 'final_report.pdf'")
    assert user.endswith("\n\n" + PAPER_INSTRUCTION)
    assert user.count("Step ") == sum(1 for t in entry.turns if t) and "Step 5" not in user
    assert "done(" in msgs[0]["content"] and "sort(" in msgs[0]["content"]  # all docs visible + done()
    traj = replay_calls(entry, PAPER, entry.ground_truth, tok)
    assert traj.termination == "done" and traj.score["paper_reward"] == 1.0
    assert len(traj.result) == 1 and all("done" not in c for s in traj.result[0] for c in s)


def test_paper_prose_wrong_and_step_limit(tok):
    entry = get_entry("multi_turn_base_0")
    prose = _run(tok, entry, PAPER, ["Sure, I will move the file."])
    assert prose.termination == "completed" and prose.score["paper_reward"] == 0.0 and prose.result == [[]]
    gold = [_calls(t) for t in entry.ground_truth if t]
    wrong = _run(tok, entry, PAPER, gold[:-1] + ["[done()]"])  # last step missing
    assert wrong.termination == "done" and wrong.score["paper_reward"] == 0.0
    malformed = _run(tok, entry, PAPER, ["[mkdir(dir_name=)]"])
    assert malformed.termination == "completed" and malformed.result == [[]]
    backend = ScriptedBackend(tok, lambda key, step, ids: "[ls()]")
    loop = run_group(backend, entry, 1, PAPER, GREEDY)[0]
    assert loop.termination == "step_limit" and loop.n_steps == PAPER.max_outputs
    assert len(loop.result[0]) == PAPER.max_outputs
    # calls before done() in the same output still run
    last = _run(tok, entry, PAPER, gold[:-1] + [gold[-1][:-1] + ", done()]"])
    assert last.termination == "done" and last.score["paper_reward"] == 1.0


def test_episode_refuses_steps_after_end():
    entry = get_entry("multi_turn_base_0")
    ep = Episode(entry, PAPER)
    ep.step("[done()]")
    assert ep.done and ep.termination == "done"
    with pytest.raises(RuntimeError):
        ep.step("[ls()]")


def test_token_sequence_matches_chat_template(tok):
    """Incremental tokens == tokenizing the template of the final messages (scripted ids are canonical)."""
    entry = get_entry("multi_turn_miss_func_0")
    for cfg in (OFFICIAL, PAPER):
        traj = replay_calls(entry, cfg, entry.ground_truth, tok, reward_token="<|high_reward|>")
        full = tok(tok.apply_chat_template(traj.messages, tokenize=False), add_special_tokens=False)["input_ids"]
        assert traj.token_ids == full
        assert traj.prompt_len == len(tok(tok.apply_chat_template(traj.messages[:2], tokenize=False,
                                                                  add_generation_prompt=True),
                                          add_special_tokens=False)["input_ids"])
        model_text = tok.decode([t for t, m in zip(traj.token_ids, traj.completion_mask) if m])
        assistant = [m["content"] for m in traj.messages if m["role"] == "assistant"]
        assert model_text == "".join(a + tok.eos_token for a in assistant)


@pytest.mark.parametrize("tokens", [["<|a|>"], ["<|a|>", "<|a|>"], ["<|a|>", " "], ["<|a]|>", "<|b|>"]])
def test_one_reward_token_check_behind_every_reader(tokens):
    """params (`reward_tokens`), the labeller (`LabelConfig`) and RL (`reward_levels`) refuse the same lists."""
    from rcgrpo_tasks.data.labels import LabelConfig
    from rcgrpo_tasks.env.prompt import reward_tokens
    from rcgrpo_tasks.train.rl.advantages import reward_levels

    for read in (lambda: reward_tokens({"label_rewards": {"tokens": tokens}}), lambda: reward_levels(tokens),
                 lambda: config_from_params(LabelConfig, "label_rewards", tokens=tuple(tokens), thresholds=(0.5,) * (len(tokens) - 1))):
        with pytest.raises(ValueError, match="reward tokens"):
            read()
