"""label_rewards: reward tokens, the sft / rctp datasets, and assistant-only loss masks (real SmolLM2 tokenizer)."""

from __future__ import annotations

import json

import pytest

from rcgrpo_tasks.config import ConfigError, from_dict
from rcgrpo_tasks.label_rewards import (
    LabelConfig, assistant_token_mask, label_rows, strip_reward_goal, token_for, with_reward_goal,
)
from rcgrpo_tasks.protocols import format_reward_goal

CHAT = [
    {"role": "system", "content": "You call functions."},
    {"role": "user", "content": "Step 1: go to docs\n\nStep 2: list them"},
    {"role": "assistant", "content": "[cd(folder='docs')]"},
    {"role": "tool", "name": "cd(folder='docs')", "content": "{\"current_working_directory\": \"docs\"}"},
    {"role": "assistant", "content": "[ls(a=True)]"},
    {"role": "tool", "name": "ls(a=True)", "content": "{\"current_directory_content\": [\"a.txt\"]}"},
    {"role": "assistant", "content": "[done()]"},
]


@pytest.fixture(scope="module")
def tok(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


def test_token_levels_binary_and_three_level():
    binary = LabelConfig()
    assert token_for(1.0, binary) == "<|high_reward|>" and token_for(0.0, binary) == "<|low_reward|>"
    three = LabelConfig(signal="partial_credit", tokens=("<|low_reward|>", "<|mid_reward|>", "<|high_reward|>"),
                        thresholds=(0.5, 1.0))
    assert [token_for(v, three) for v in (0.0, 0.49, 0.5, 0.99, 1.0)] == [
        "<|low_reward|>", "<|low_reward|>", "<|mid_reward|>", "<|mid_reward|>", "<|high_reward|>"]


@pytest.mark.parametrize("bad", [
    {"tokens": ["<|a|>"], "thresholds": []},
    {"tokens": ["<|a|>", "<|b|>"], "thresholds": [0.2, 0.5]},
    {"tokens": ["<|a|>", "<|b|>", "<|c|>"], "thresholds": [0.5, 0.5]},
    {"tokens": ["<|a|>", "<|a|>"], "thresholds": [0.5]},
    {"signal": "vibes"},
])
def test_bad_label_config_rejected(bad):
    with pytest.raises(ConfigError):
        from_dict(LabelConfig, bad, "params.yaml:label_rewards")


def test_reward_goal_appended_to_first_user_message_only():
    out = with_reward_goal(CHAT, "<|high_reward|>")
    assert out[1]["content"] == CHAT[1]["content"] + "\n\n[Reward Goal: <|high_reward|>]"
    assert [m["content"] for i, m in enumerate(out) if i != 1] == [m["content"] for i, m in enumerate(CHAT) if i != 1]
    assert CHAT[1]["content"].endswith("list them")  # input untouched
    assert strip_reward_goal(out, "<|high_reward|>") == CHAT


def _row(tid, reward, source, messages=CHAT, token=None):
    return {"trajectory_id": tid, "entry_id": "multi_turn_base_1", "protocol": "paper", "reward_token": token,
            "messages": messages, "score": {"paper_reward": reward, "valid": False, "partial_credit": 0.5},
            "provenance": {"source": source, "reward": reward, "script_score": {"partial_credit": 0.75}}}


def test_label_rows_sft_successes_only_rctp_all_rows():
    conditioned = with_reward_goal(CHAT, "<|low_reward|>")  # a policy sampled under a goal: relabelled
    rows = [_row("a", 1.0, "expert"), _row("b", 0.0, "near_miss"), _row("c", 0.0, "policy", conditioned, "<|low_reward|>")]
    data = label_rows(rows, LabelConfig(), "paper_reward")
    assert [r["trajectory_id"] for r in data["sft"]] == ["a"]
    assert data["sft"][0]["reward_token"] is None and data["sft"][0]["messages"] == CHAT
    assert [(r["trajectory_id"], r["reward_token"]) for r in data["rctp"]] == [
        ("a", "<|high_reward|>"), ("b", "<|low_reward|>"), ("c", "<|low_reward|>")]
    for r in data["rctp"]:
        assert set(r) == {"messages", "trajectory_id", "entry_id", "reward_token", "reward"}
        first = next(m for m in r["messages"] if m["role"] == "user")["content"]
        assert first.count("[Reward Goal:") == 1 and first.endswith(format_reward_goal(r["reward_token"]))
    # 3 levels on partial credit: the paper protocol uses the per-turn script's partial credit (0.75).
    three = LabelConfig(signal="partial_credit", tokens=("<|low_reward|>", "<|mid_reward|>", "<|high_reward|>"),
                        thresholds=(0.5, 1.0))
    assert {r["reward_token"] for r in label_rows(rows, three, "paper_reward")["rctp"]} == {"<|mid_reward|>"}


def test_mask_covers_exactly_assistant_replies(tok):
    chat = with_reward_goal(CHAT, "<|high_reward|>")
    ids, mask = assistant_token_mask(tok, chat)
    assert len(ids) == len(mask)
    # Round trip: the ids are the chat template's own tokenization.
    assert ids == list(tok.apply_chat_template(chat, tokenize=True)["input_ids"])
    eos = tok.eos_token
    learned = tok.decode([i for i, m in zip(ids, mask) if m])
    assert learned == "".join(m["content"] + eos for m in chat if m["role"] == "assistant")
    ignored = tok.decode([i for i, m in zip(ids, mask) if not m])
    for m in chat:
        if m["role"] != "assistant":
            assert m["content"] in ignored  # prompts, reward goal and tool outputs are all masked
    assert "[Reward Goal: <|high_reward|>]" not in learned and "current_working_directory" not in learned
    # Each masked run starts right after the `<|im_start|>assistant\n` header.
    starts = [k for k in range(len(mask)) if mask[k] and not mask[k - 1]]
    assert len(starts) == 3
    for k in starts:
        assert tok.decode(ids[k - 3:k]).endswith("assistant\n")


def test_mask_on_reward_tokens_added_as_special_tokens(tok):
    import copy

    tok2 = copy.deepcopy(tok)
    tok2.add_special_tokens({"additional_special_tokens": ["<|low_reward|>", "<|high_reward|>"]})
    chat = with_reward_goal(CHAT, "<|high_reward|>")
    ids, mask = assistant_token_mask(tok2, chat)
    high = tok2.convert_tokens_to_ids("<|high_reward|>")
    assert ids.count(high) == 1 and mask[ids.index(high)] == 0


def test_mask_rejects_assistant_first(tok):
    with pytest.raises(ValueError):
        assistant_token_mask(tok, [{"role": "assistant", "content": "hi"}])


def test_dataset_rows_are_json_serialisable():
    data = label_rows([_row("a", 1.0, "expert")], LabelConfig(), "paper_reward")
    assert json.loads(json.dumps(data["rctp"][0]))["reward_token"] == "<|high_reward|>"


# ---------------------------------------------------------------------------------------------------
# On real generated trajectories, and the three stage CLIs end to end


def _params(tmp_path, **over):
    import yaml

    params = {
        "generate_trajectories": {"policy_entries": 0, **over.get("generate", {})},
        "validate_trajectories": {"data_docs": False, **over.get("validate", {})},
        "label_rewards": {},
    }
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    return path


@pytest.fixture(scope="module")
def chain(tmp_path_factory, tiny_model_dir):
    """generate -> validate -> label through their Typer CLIs (as `dvc repro` runs them)."""
    from typer.testing import CliRunner

    from rcgrpo_tasks import generate_trajectories, label_rewards, validate_trajectories
    from rcgrpo_tasks.bfcl import load_entries
    from test_generate_trajectories import write_inputs

    tmp = tmp_path_factory.mktemp("chain")
    mp = pytest.MonkeyPatch()
    mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp}/mlflow.db")
    mp.setenv("MLFLOW_ARTIFACT_ROOT", str(tmp / "mlartifacts"))
    mp.delenv("RCGRPO_PARENT_RUN_ID", raising=False)
    entries, split = write_inputs(tmp, load_entries()[3::70], n_train=8, n_test=3)
    params = _params(tmp)
    runner = CliRunner()
    common = ["--params", str(params), "--model-dir", str(tiny_model_dir)]
    results = {
        "generate": runner.invoke(generate_trajectories.app, common + [
            "--entries", str(entries), "--split", str(split), "--out", str(tmp / "traj.jsonl"),
            "--metrics", str(tmp / "m_gen.json")]),
        "validate": runner.invoke(validate_trajectories.app, common + [
            "--trajectories", str(tmp / "traj.jsonl"), "--split", str(split), "--out-dir", str(tmp / "validation"),
            "--metrics", str(tmp / "m_val.json")]),
        "label": runner.invoke(label_rewards.app, common + [
            "--trajectories", str(tmp / "traj.jsonl"), "--validation", str(tmp / "validation"),
            "--out-dir", str(tmp / "datasets"), "--metrics", str(tmp / "m_label.json")]),
    }
    yield {"tmp": tmp, "results": results, "split": split, "runner": runner, "common": common}
    mp.undo()


def test_cli_chain_writes_datasets_and_metrics(chain):
    tmp = chain["tmp"]
    for name, res in chain["results"].items():
        assert res.exit_code == 0, f"{name}: {res.output}"
    gen = json.loads((tmp / "m_gen.json").read_text())
    val = json.loads((tmp / "m_val.json").read_text())
    lab = json.loads((tmp / "m_label.json").read_text())
    assert val["passed"] is True and val["n_rows"] == gen["n_rows"]
    assert lab["rctp"]["n_rows"] == gen["n_rows"] and lab["sft"]["n_rows"] == gen["n_success"]
    assert lab["rctp"]["class_balance"] == {"<|high_reward|>": gen["n_success"], "<|low_reward|>": gen["n_failure"]}
    assert 0 < lab["rctp"]["tokens"]["assistant"] < lab["rctp"]["tokens"]["total"]


def test_real_datasets_masks_match_engine_and_template(chain, tok):
    from rcgrpo_tasks.trajectory import read_trajectories

    tmp = chain["tmp"]
    trajs = {t.trajectory_id: t for t in read_trajectories(tmp / "traj.jsonl")}
    sft = [json.loads(line) for line in (tmp / "datasets" / "sft.jsonl").read_text().splitlines()]
    rctp = [json.loads(line) for line in (tmp / "datasets" / "rctp.jsonl").read_text().splitlines()]
    for row in sft:  # no goal: the template round trip gives exactly the engine's tokens and mask
        ids, mask = assistant_token_mask(tok, row["messages"])
        t = trajs[row["trajectory_id"]]
        assert ids == t.token_ids and mask == t.completion_mask
    for row in rctp:
        ids, mask = assistant_token_mask(tok, row["messages"])
        assert ids == list(tok.apply_chat_template(row["messages"], tokenize=True)["input_ids"])
        learned = tok.decode([i for i, m in zip(ids, mask) if m])
        assert learned == "".join(m["content"] + tok.eos_token for m in row["messages"] if m["role"] == "assistant")
        assert f"[Reward Goal: {row['reward_token']}]" in tok.decode([i for i, m in zip(ids, mask) if not m])


def test_cli_gate_failure_is_readable_and_blocks_labelling(chain, tmp_path):
    from rcgrpo_tasks import label_rewards, validate_trajectories

    runner, common = chain["runner"], chain["common"]
    rows = [json.loads(line) for line in (chain["tmp"] / "traj.jsonl").read_text().splitlines()]
    rows[0]["entry_id"] = json.loads(chain["split"].read_text())["test"][0]  # leak a held-out id
    bad = tmp_path / "traj.jsonl"
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = runner.invoke(validate_trajectories.app, common + [
        "--trajectories", str(bad), "--split", str(chain["split"]), "--out-dir", str(tmp_path / "validation"),
        "--metrics", str(tmp_path / "m_val.json")])
    assert res.exit_code == 1
    assert "no_test_leakage [expect_column_values_to_not_be_in_set(column=entry_id)]: 1 row(s)" in res.output
    assert rows[0]["trajectory_id"] in res.output and "validation_result.json" in res.output
    assert json.loads((tmp_path / "m_val.json").read_text())["passed"] is False
    res = runner.invoke(label_rewards.app, common + [
        "--trajectories", str(bad), "--validation", str(tmp_path / "validation"),
        "--out-dir", str(tmp_path / "datasets"), "--metrics", str(tmp_path / "m_label.json")])
    assert res.exit_code == 1 and "has not passed validate_trajectories" in res.output
    assert not (tmp_path / "datasets").exists() and not (tmp_path / "m_label.json").exists()
