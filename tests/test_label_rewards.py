"""label_rewards: reward tokens, the pairing rule of the rctp set (hand-built rows), the sft / rctp datasets,
assistant-only loss masks (real SmolLM2 tokenizer), and the data chain generate -> validate -> sample_policy
-> validate (on-policy file) -> label through the stage CLIs."""

from __future__ import annotations

import json

import pytest
from helpers import config_from_params, write_params
from test_generate_trajectories import MULTI_MIX

from rcgrpo.goal import format_goal, place_goal, remove_goal
from rcgrpo_tasks.data.chat import assistant_token_mask
from rcgrpo_tasks.data.labels import (
    LabelConfig,
    label_rows,
    read_policy,
    token_for,
)
from rcgrpo_tasks.data.pairing import check_policy_rows, rctp_rows
from rcgrpo_tasks.ops.config import ConfigError
from rcgrpo_tasks.ops.inputs import InputError

CHAT = [
    {"role": "system", "content": "You call functions."},
    {"role": "user", "content": "Step 1: go to docs\n\nStep 2: list them"},
    {"role": "assistant", "content": "[cd(folder='docs')]"},
    {"role": "tool", "name": "cd(folder='docs')", "content": "{\"current_working_directory\": \"docs\"}"},
    {"role": "assistant", "content": "[ls(a=True)]"},
    {"role": "tool", "name": "ls(a=True)", "content": "{\"current_directory_content\": [\"a.txt\"]}"},
    {"role": "assistant", "content": "[done()]"},
]


def test_token_levels_binary_and_three_level():
    binary = config_from_params(LabelConfig, "label_rewards")
    assert token_for(1.0, binary) == "<|high_reward|>" and token_for(0.0, binary) == "<|low_reward|>"
    three = config_from_params(LabelConfig, "label_rewards", signal="partial_credit", tokens=("<|low_reward|>", "<|mid_reward|>", "<|high_reward|>"),
                        thresholds=(0.5, 1.0))
    assert [token_for(v, three) for v in (0.0, 0.49, 0.5, 0.99, 1.0)] == [
        "<|low_reward|>", "<|low_reward|>", "<|mid_reward|>", "<|mid_reward|>", "<|high_reward|>"]
    # With the outcome known: a success always gets the top token, a failure never does.
    assert token_for(0.2, three, success=True) == "<|high_reward|>"
    assert token_for(1.0, three, success=False) == "<|mid_reward|>"
    assert token_for(0.4, three, success=False) == "<|low_reward|>"


@pytest.mark.parametrize("bad", [
    {"tokens": ["<|a|>"], "thresholds": []},
    {"tokens": ["<|a|>", "<|b|>"], "thresholds": [0.2, 0.5]},
    {"tokens": ["<|a|>", "<|b|>", "<|c|>"], "thresholds": [0.5, 0.5]},
    {"tokens": ["<|a|>", "<|a|>"], "thresholds": [0.5]},
    {"signal": "vibes"},
    {"failures": "whatever"},
    {"pairing": "sometimes"},
])
def test_bad_label_config_rejected(bad):
    with pytest.raises(ConfigError):
        config_from_params(LabelConfig, "label_rewards", **bad)


def test_reward_goal_appended_to_first_user_message_only():
    out = place_goal(CHAT, format_goal("<|high_reward|>"), "first_user")
    assert out[1]["content"] == CHAT[1]["content"] + "\n\n[Reward Goal: <|high_reward|>]"
    assert [m["content"] for i, m in enumerate(out) if i != 1] == [m["content"] for i, m in enumerate(CHAT) if i != 1]
    assert CHAT[1]["content"].endswith("list them")  # input untouched
    assert remove_goal(out, format_goal("<|high_reward|>")) == CHAT


def _row(tid, reward, source, messages=CHAT, token=None):
    return {"trajectory_id": tid, "entry_id": "multi_turn_base_1", "protocol": "paper", "reward_token": token,
            "messages": messages, "score": {"paper_reward": reward, "valid": False, "partial_credit": 0.5},
            "provenance": {"source": source, "reward": reward, "script_score": {"partial_credit": 0.75}}}


def test_label_rows_sft_successes_only_rctp_all_rows():
    conditioned = place_goal(CHAT, format_goal("<|low_reward|>"), "first_user")  # a policy sampled under a goal: relabelled
    rows = [_row("a", 1.0, "expert"), _row("b", 0.0, "near_miss"), _row("c", 0.0, "policy", conditioned, "<|low_reward|>")]
    data = label_rows(rows, config_from_params(LabelConfig, "label_rewards"), "paper_reward")
    assert [r["trajectory_id"] for r in data["sft"]] == ["a"]
    assert data["sft"][0]["reward_token"] is None and data["sft"][0]["messages"] == CHAT
    assert [(r["trajectory_id"], r["reward_token"]) for r in data["rctp"]] == [
        ("a", "<|high_reward|>"), ("b", "<|low_reward|>"), ("c", "<|low_reward|>")]
    for r in data["rctp"]:
        assert set(r) == {"messages", "trajectory_id", "entry_id", "reward_token", "reward", "kind"}
        first = next(m for m in r["messages"] if m["role"] == "user")["content"]
        assert first.count("[Reward Goal:") == 1 and first.endswith(format_goal(r["reward_token"]))
    # 3 levels on partial credit: the paper protocol uses the per-turn script's partial credit (0.75): the
    # failures get mid; the success gets high whatever its partial credit.
    three = config_from_params(LabelConfig, "label_rewards", signal="partial_credit", tokens=("<|low_reward|>", "<|mid_reward|>", "<|high_reward|>"),
                        thresholds=(0.5, 1.0))
    assert [r["reward_token"] for r in label_rows(rows, three, "paper_reward")["rctp"]] == [
        "<|high_reward|>", "<|mid_reward|>", "<|mid_reward|>"]


def test_mask_covers_exactly_assistant_replies(tok):
    chat = place_goal(CHAT, format_goal("<|high_reward|>"), "first_user")
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
    chat = place_goal(CHAT, format_goal("<|high_reward|>"), "first_user")
    ids, mask = assistant_token_mask(tok2, chat)
    high = tok2.convert_tokens_to_ids("<|high_reward|>")
    assert ids.count(high) == 1 and mask[ids.index(high)] == 0


def test_mask_rejects_assistant_first(tok):
    with pytest.raises(ValueError):
        assistant_token_mask(tok, [{"role": "assistant", "content": "hi"}])


def test_dataset_rows_are_json_serialisable():
    data = label_rows([_row("a", 1.0, "expert")], config_from_params(LabelConfig, "label_rewards"), "paper_reward")
    assert json.loads(json.dumps(data["rctp"][0]))["reward_token"] == "<|high_reward|>"


# ---------------------------------------------------------------------------------------------------
# The pairing rule of the rctp set, on hand-built rows


def _traj(entry: str, source: str, reward: float, i: int = 0) -> dict:
    kind = {"expert": "expert", "near_miss": "wrong_function", "policy": "on_policy", "base": "policy"}[source]
    return {"trajectory_id": f"{entry}.{kind}.{i}", "entry_id": entry, "protocol": "paper", "reward_token": None,
            "messages": CHAT, "score": {"paper_reward": reward, "partial_credit": 0.0},
            "provenance": {"source": "policy" if source == "base" else source, "kind": kind, "reward": reward,
                           "script_score": None}}


# A: own success and failures; B: own failures only (expert success); C: own successes only (near-miss
# fallback); D: own failure, no expert; E: not sampled; F: own success, no near-miss. A also has a
# base-policy failure in the generate set, which the paired designs never use.
GENERATED = [_traj("A", "expert", 1.0), _traj("A", "base", 0.0), _traj("B", "expert", 1.0), _traj("B", "near_miss", 0.0),
             _traj("C", "expert", 1.0), _traj("C", "near_miss", 0.0), _traj("E", "expert", 1.0),
             _traj("E", "near_miss", 0.0), _traj("F", "expert", 1.0)]
POLICY = [_traj("A", "policy", 0.0, 0), _traj("A", "policy", 1.0, 1), _traj("A", "policy", 0.0, 2),
          _traj("B", "policy", 0.0, 0), _traj("B", "policy", 0.0, 1), _traj("C", "policy", 1.0, 0),
          _traj("C", "policy", 1.0, 1), _traj("D", "policy", 0.0, 0), _traj("F", "policy", 1.0, 0)]


def _ids(rows):
    return [r["trajectory_id"] for r in rows]


@pytest.mark.parametrize("failures,expected,dropped", [
    ("mixed", ["A.on_policy.1", "A.on_policy.0", "B.expert.0", "B.on_policy.0", "C.on_policy.0",
               "C.wrong_function.0"], {"no_failure": 1, "no_success": 1}),
    ("on_policy", ["A.on_policy.1", "A.on_policy.0", "B.expert.0", "B.on_policy.0"],
     {"no_failure": 2, "no_success": 1}),
    ("near_miss", ["B.expert.0", "B.wrong_function.0", "C.on_policy.0", "C.wrong_function.0", "E.expert.0",
                   "E.wrong_function.0"], {"no_failure": 2}),
])
def test_paired_rule_every_prompt_under_both_tokens(failures, expected, dropped):
    """Own success first, else the expert; the failure by the rule; entries lacking either are dropped."""
    rows, stats = rctp_rows(GENERATED, POLICY, failures, "paired")
    assert _ids(rows) == expected and stats["dropped"] == dropped
    assert stats["n_success"] == stats["n_failure"] == stats["prompts_used"] == stats["prompts_under_both_outcomes"]
    data = label_rows(rows, config_from_params(LabelConfig, "label_rewards"), "paper_reward")["rctp"]
    tokens: dict[str, list[str]] = {}
    for r in data:
        tokens.setdefault(r["entry_id"], []).append(r["reward_token"])
    assert all(sorted(t) == ["<|high_reward|>", "<|low_reward|>"] for t in tokens.values())


def test_the_wrong_call_rule_pairs_a_call_that_is_wrong_never_prose():
    """`wrong_call`: the entry's first own failure that holds a call (A's third sample, not its prose first one;
    B's first); an entry whose own failures are all prose (D here has no success either; C has no failure) is
    dropped, near misses never stand in."""
    calls = {("A", 0): [[]], ("A", 2): [[["f(a=2)"]]], ("B", 0): [[["g(x=1)"]]], ("B", 1): [[]], ("D", 0): [[]]}
    policy = [{**r, "result": calls.get((r["entry_id"], int(r["trajectory_id"].rsplit(".", 1)[1])), [[["f()"]]])}
              for r in POLICY]
    rows, stats = rctp_rows(GENERATED, policy, "wrong_call", "paired")
    assert _ids(rows) == ["A.on_policy.1", "A.on_policy.2", "B.expert.0", "B.on_policy.0"]
    assert stats["dropped"] == {"no_failure": 2, "neither": 1}  # C and F: no failure; D: prose and no success
    prose_only = [{**r, "result": [[]]} for r in policy]
    assert rctp_rows(GENERATED, prose_only, "wrong_call", "paired")[0] == []
    assert config_from_params(LabelConfig, "label_rewards", failures="wrong_call", base_failures=False).failures == "wrong_call"


def test_base_failures_add_a_pair_per_unused_entry():
    """A base-model failure pairs its entry when the rule left the entry out; an entry the rule already pairs
    keeps its one pair (A), so every prompt is still under each token once."""
    extra = GENERATED + [_traj("G", "expert", 1.0), _traj("G", "base", 0.0), _traj("H", "base", 0.0)]
    rows, stats = rctp_rows(extra, POLICY, "mixed", "paired", base_failures=True)
    plain, _ = rctp_rows(extra, POLICY, "mixed", "paired")
    assert _ids(rows) == _ids(plain) + ["G.expert.0", "G.policy.0"]  # H: no success to pair it with
    assert stats["base_pairs"] == 1 and stats["n_success"] == stats["n_failure"] == stats["prompts_used"] == 4
    with pytest.raises(ValueError, match="needs pairing"):
        rctp_rows(extra, POLICY, "mixed", "unpaired", base_failures=True)
    with pytest.raises(ValueError, match="needs pairing"):
        config_from_params(LabelConfig, "label_rewards", base_failures=True, pairing="unpaired")


def test_unpaired_one_token_per_prompt_balanced():
    rows, stats = rctp_rows(GENERATED, POLICY, "mixed", "unpaired", seed=3)
    entries = [r["entry_id"] for r in rows]
    assert len(entries) == len(set(entries)) == 4  # one row per prompt; A, B, C, D, F usable, one left out
    assert stats["n_success"] == stats["n_failure"] == 2 and stats["dropped"] == {"balance": 1}
    assert stats["prompts_under_both_outcomes"] == 0
    assert "D" in entries and next(r for r in rows if r["entry_id"] == "D")["provenance"]["reward"] == 0.0
    assert rctp_rows(GENERATED, POLICY, "mixed", "unpaired", seed=3)[0] == rows  # seeded
    # unpaired + near_miss = today's behaviour: the generate set as it is, no on-policy row
    same, stats = rctp_rows(GENERATED, POLICY, "near_miss", "unpaired")
    assert same == GENERATED and stats["failure_sources"] == {"near_miss": 3, "policy": 1}


def test_policy_input_checks():
    with pytest.raises(InputError, match="not an on-policy sample"):
        check_policy_rows(GENERATED, "data/policy/trajectories.jsonl")
    with pytest.raises(ConfigError, match="needs the on-policy samples"):
        read_policy(config_from_params(LabelConfig, "label_rewards", failures="mixed"), None, None)
    assert read_policy(config_from_params(LabelConfig, "label_rewards", failures="near_miss", pairing="paired"), None, None) == []


# ---------------------------------------------------------------------------------------------------
# On real generated trajectories, and the three stage CLIs end to end


def _params(tmp_path, **over):
    params = {
        "generate_trajectories": {"policy_entries": 0, "failure_mix": MULTI_MIX, "max_outputs": 20,
                                  "max_new_tokens": 64, "dtype": "auto", **over.get("generate", {})},
        "validate_trajectories": {"data_docs": False, **over.get("validate", {})},
        "sample_policy": {"n_entries": 3, "samples_per_entry": 1, "max_samples_per_entry": 2, "max_outputs": 1,
                          "max_new_tokens": 4, "dtype": "float32", "batch_rows": 4},
        "prompt": {"system_prompt": "bfcl"},
        "label_rewards": {},
    }
    return write_params(tmp_path / "params.yaml", params)


@pytest.fixture(scope="module")
def chain(tmp_path_factory, tiny_model_dir):
    """generate -> validate -> sample_policy -> validate --no-balance -> label sft / rctp through their Typer
    CLIs (as `dvc repro` runs them); the tiny random model's samples all fail."""
    from test_generate_trajectories import write_inputs
    from typer.testing import CliRunner

    from rcgrpo_tasks.env.multi_turn.entries import load_entries
    from rcgrpo_tasks.stages import generate_trajectories, label_rewards, sample_policy, validate_trajectories

    tmp = tmp_path_factory.mktemp("chain")
    mp = pytest.MonkeyPatch()
    mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp}/mlflow.db")
    mp.setenv("MLFLOW_ARTIFACT_ROOT", str(tmp / "mlartifacts"))
    mp.delenv("RCGRPO_PARENT_RUN_ID", raising=False)
    entries, split = write_inputs(tmp, load_entries()[3::70], n_train=8, n_test=3)
    params = _params(tmp)
    runner = CliRunner()
    common = ["--params", str(params), "--model-dir", str(tiny_model_dir)]
    policy = tmp / "policy" / "trajectories.jsonl"
    steps = [
        ("generate", generate_trajectories.app, common + [
            "--entries", str(entries), "--split", str(split), "--out", str(tmp / "traj.jsonl"),
            "--metrics", str(tmp / "m_gen.json")]),
        ("validate", validate_trajectories.app, common + [
            "--trajectories", str(tmp / "traj.jsonl"), "--split", str(split), "--out-dir", str(tmp / "validation"),
            "--metrics", str(tmp / "m_val.json")]),
        ("label_sft", label_rewards.app, common + [
            "--dataset", "sft", "--trajectories", str(tmp / "traj.jsonl"), "--validation", str(tmp / "validation"),
            "--out", str(tmp / "datasets" / "sft.jsonl"), "--metrics", str(tmp / "m_label_sft.json")]),
        ("sample", sample_policy.app, common + [
            "--adapter-dir", "", "--entries", str(entries), "--split", str(split), "--out", str(policy),
            "--metrics", str(tmp / "m_sample.json")]),
        ("validate_policy", validate_trajectories.app, common + [
            "--trajectories", str(policy), "--split", str(split), "--out-dir", str(tmp / "policy" / "validation"),
            "--metrics", str(tmp / "m_val_policy.json"), "--no-balance"]),
        ("label_rctp", label_rewards.app, common + [
            "--dataset", "rctp", "--trajectories", str(tmp / "traj.jsonl"), "--validation", str(tmp / "validation"),
            "--policy", str(policy), "--policy-validation", str(tmp / "policy" / "validation"),
            "--out", str(tmp / "datasets" / "rctp.jsonl"), "--metrics", str(tmp / "m_label_rctp.json")]),
    ]
    results = {name: runner.invoke(app, args) for name, app, args in steps}
    yield {"tmp": tmp, "results": results, "split": split, "runner": runner, "common": common, "policy": policy}
    mp.undo()


def _read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_cli_chain_writes_datasets_and_metrics(chain):
    tmp = chain["tmp"]
    for name, res in chain["results"].items():
        assert res.exit_code == 0, f"{name}: {res.output}"
    gen = json.loads((tmp / "m_gen.json").read_text())
    val = json.loads((tmp / "m_val.json").read_text())
    sft = json.loads((tmp / "m_label_sft.json").read_text())
    rctp = json.loads((tmp / "m_label_rctp.json").read_text())
    sample = json.loads((tmp / "m_sample.json").read_text())
    assert val["passed"] is True and val["n_rows"] == gen["n_rows"]
    assert sft["n_rows"] == gen["n_success"] and sft["class_balance"] == {"None": gen["n_success"]}
    # The tiny random model never succeeds: every entry is sampled to the cap, and every rctp pair is
    # (expert, own failure): the default design, failures mixed + paired.
    assert sample["n_entries"] == 3 and sample["samples"] == 6 and sample["rounds"] == 2
    assert sample["entries_only_failure"] == 3 and sample["success_rate_first_round"] == 0.0
    pairing = rctp["pairing"]
    assert pairing["prompts_used"] == pairing["prompts_under_both_outcomes"] >= 1
    assert rctp["n_rows"] == 2 * pairing["prompts_used"]
    assert rctp["class_balance"] == {"<|high_reward|>": pairing["prompts_used"], "<|low_reward|>": pairing["prompts_used"]}
    assert pairing["success_sources"] == {"expert": pairing["prompts_used"]}
    assert pairing["failure_sources"] == {"policy": pairing["prompts_used"]}
    assert 0 < rctp["tokens"]["assistant"] < rctp["tokens"]["total"]


def test_on_policy_rows_carry_provenance_and_pass_the_gate(chain):
    tmp = chain["tmp"]
    rows = _read(chain["policy"])
    val = json.loads((tmp / "m_val_policy.json").read_text())
    assert val["passed"] is True and "success_balance" not in val["failed_checks"] and val["success_fraction"] == 0.0
    train = set(json.loads(chain["split"].read_text())["train"])
    for i, r in enumerate(rows):
        p = r["provenance"]
        assert (p["source"], p["kind"], p["generator"]) == ("policy", "on_policy", "policy")
        assert p["sample_index"] == i % 2 and p["round"] == i % 2 and p["seed"] == 0 and p["adapter"] is None
        assert p["sampling"]["temperature"] == 0.7 and p["reward"] == r["score"]["paper_reward"]
        assert r["trajectory_id"] == f"{r['entry_id']}.on_policy.{p['sample_index']}" and r["entry_id"] in train
    rctp = _read(tmp / "datasets" / "rctp.jsonl")
    by_id = {r["trajectory_id"]: r for r in rows}
    for row in rctp:
        if row["reward_token"] == "<|low_reward|>":
            assert by_id[row["trajectory_id"]]["messages"][-1] == row["messages"][-1]  # the model's own failure


def test_raw_samples_fail_the_balance_check_and_a_leak_blocks_rctp(chain, tmp_path):
    """Without --no-balance the raw samples (all failures here) fail `success_balance`; a held-out id among
    the on-policy rows fails the gate and label_rewards@rctp refuses to write anything."""
    from rcgrpo_tasks.stages import label_rewards, validate_trajectories

    runner, common, tmp = chain["runner"], chain["common"], chain["tmp"]
    res = runner.invoke(validate_trajectories.app, common + [
        "--trajectories", str(chain["policy"]), "--split", str(chain["split"]), "--out-dir",
        str(tmp_path / "v_bal"), "--metrics", str(tmp_path / "m_bal.json")])
    assert res.exit_code == 1 and "success_balance" in res.output
    rows = _read(chain["policy"])
    rows[0]["entry_id"] = rows[0]["id"] = json.loads(chain["split"].read_text())["test"][0]
    bad = tmp_path / "policy.jsonl"
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = runner.invoke(validate_trajectories.app, common + [
        "--trajectories", str(bad), "--split", str(chain["split"]), "--out-dir", str(tmp_path / "validation"),
        "--metrics", str(tmp_path / "m_val.json"), "--no-balance"])
    assert res.exit_code == 1 and "no_test_leakage" in res.output
    res = runner.invoke(label_rewards.app, common + [
        "--dataset", "rctp", "--trajectories", str(tmp / "traj.jsonl"), "--validation", str(tmp / "validation"),
        "--policy", str(bad), "--policy-validation", str(tmp_path / "validation"),
        "--out", str(tmp_path / "rctp.jsonl"), "--metrics", str(tmp_path / "m.json")])
    assert res.exit_code == 1 and "has not passed validate_trajectories" in res.output
    assert not (tmp_path / "rctp.jsonl").exists() and not (tmp_path / "m.json").exists()


def test_real_datasets_masks_match_engine_and_template(chain, tok):
    from rcgrpo_tasks.engine.trajectory import read_trajectories

    tmp = chain["tmp"]
    trajs = {t.trajectory_id: t for t in read_trajectories(tmp / "traj.jsonl")}
    sft = _read(tmp / "datasets" / "sft.jsonl")
    rctp = _read(tmp / "datasets" / "rctp.jsonl")
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
    from rcgrpo_tasks.stages import label_rewards, validate_trajectories

    runner, common = chain["runner"], chain["common"]
    rows = _read(chain["tmp"] / "traj.jsonl")
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
        "--dataset", "sft", "--trajectories", str(bad), "--validation", str(tmp_path / "validation"),
        "--out", str(tmp_path / "datasets" / "sft.jsonl"), "--metrics", str(tmp_path / "m_label.json")])
    assert res.exit_code == 1 and "has not passed validate_trajectories" in res.output
    assert not (tmp_path / "datasets").exists() and not (tmp_path / "m_label.json").exists()
