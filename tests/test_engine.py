"""Rollout engine: gold replay over all 800 entries, hf log-probs vs a fresh forward pass, context limit."""

from __future__ import annotations

import collections

import pytest
from helpers import device_under_test, get_entry, on_test_device

from rcgrpo_tasks.engine.backend import SamplingParams, ScriptedBackend
from rcgrpo_tasks.engine.hf import HFBackend
from rcgrpo_tasks.engine.rollout import replay_calls, run_group, run_rollouts
from rcgrpo_tasks.engine.trajectory import Trajectory
from rcgrpo_tasks.env.multi_turn import entries as multi_turn
from rcgrpo_tasks.env.prompt import PromptConfig

OFFICIAL = PromptConfig("official", "compact", "bfcl").protocol_config(20)
PAPER = PromptConfig("paper", "compact", "bfcl").protocol_config(4)


@pytest.fixture(scope="module")
def tiny_backend(tiny_model_dir):
    """The hf backend as a stage places it (`device: auto`: the device under test)."""
    backend = HFBackend(tiny_model_dir)
    assert on_test_device(backend.model.device)
    return backend


def test_gold_replay_scores_100_percent_on_all_800_official(tok):
    entries = multi_turn.load_entries()
    assert len(entries) == 800
    failed, per_cat = [], collections.Counter()
    for e in entries:
        traj = replay_calls(e, OFFICIAL, e.ground_truth, tok)
        per_cat[e.category] += 1
        if not (traj.score["valid"] and traj.termination == "completed" and traj.score["partial_credit"] == 1.0):
            failed.append((e.id, traj.termination, traj.score["error_type"]))
    assert not failed, failed[:5]
    assert set(per_cat.values()) == {200}


@pytest.mark.slow
def test_gold_replay_paper_reward_100_percent_on_all_800(tok):
    failed = [e.id for e in multi_turn.load_entries()
              if replay_calls(e, PromptConfig("paper", "compact", "bfcl").protocol_config(20), e.ground_truth, tok).score["paper_reward"] != 1.0]
    assert not failed, failed[:5]


def _fresh_logprobs(model, traj: Trajectory, temperature: float):
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([traj.token_ids], device=model.device)).logits[0].float().cpu()
    if temperature > 0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    return [logp[i - 1, t].item() for i, t in enumerate(traj.token_ids) if traj.completion_mask[i]]


def _assert_logprobs_match(model, trajs, temperature):
    for traj in trajs:
        sampled = [lp for lp, m in zip(traj.logprobs, traj.completion_mask) if m]
        fresh = _fresh_logprobs(model, traj, temperature)
        assert len(sampled) == len(fresh) == traj.n_model_tokens > 0
        assert max(abs(a - b) for a, b in zip(sampled, fresh)) < 1e-3


def test_hf_group_logprobs_match_fresh_forward(tiny_backend):
    """Multi-turn (official: one generation per turn, KV cache extended with each new user turn)."""
    entry = get_entry("multi_turn_base_0")
    sampling = SamplingParams(temperature=0.8, top_p=0.95, max_new_tokens=6, seed=1)
    trajs = run_group(tiny_backend, entry, 3, OFFICIAL, sampling, ["<|high_reward|>", "<|low_reward|>", None])
    assert [t.reward_token for t in trajs] == ["<|high_reward|>", "<|low_reward|>", None]
    assert all(t.n_steps == len(entry.turns) for t in trajs)  # random model: prose -> every turn ends at once
    _assert_logprobs_match(tiny_backend.model, trajs, 0.8)
    again = run_group(tiny_backend, entry, 3, OFFICIAL, sampling, ["<|high_reward|>", "<|low_reward|>", None])
    assert [t.token_ids for t in again] == [t.token_ids for t in trajs]  # seeded per entry


def test_hf_batched_entries_and_greedy(tiny_backend):
    entries = [get_entry(i) for i in ("multi_turn_base_1", "multi_turn_miss_func_2", "multi_turn_miss_param_3")]
    sampling = SamplingParams(temperature=0.0, max_new_tokens=5)
    trajs = run_rollouts(tiny_backend, entries, 2, PAPER, sampling, batch_rows=4)
    assert [t.entry_id for t in trajs] == [e.id for e in entries for _ in range(2)]
    _assert_logprobs_match(tiny_backend.model, trajs, 0.0)
    assert trajs[0].token_ids == trajs[1].token_ids  # greedy: both rollouts of a group agree


def test_hf_from_model_peft_training_mode(tiny_model_dir, tok):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).to(device_under_test())  # where RL trains
    model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.5))
    model.train()
    backend = HFBackend.from_model(model, tok)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=4, seed=0)
    trajs = run_group(backend, get_entry("multi_turn_base_5"), 2, OFFICIAL, sampling)
    assert model.training  # restored after sampling
    model.eval()
    _assert_logprobs_match(model, trajs, 1.0)
    for t in trajs:  # what the RL trainer slices out
        completion_mask = t.completion_mask[t.prompt_len:]
        assert completion_mask[0] == 1 and len(t.token_ids[t.prompt_len:]) == len(completion_mask)


def test_context_limit_terminates_without_overflow(tok):
    entry = get_entry("multi_turn_base_0")
    prompt_len = replay_calls(entry, OFFICIAL, [[]], tok).prompt_len
    backend = ScriptedBackend(tok, lambda key, step, ids: "[ls(a=True)]", max_positions=prompt_len + 120)
    traj = run_group(backend, entry, 1, OFFICIAL, SamplingParams(temperature=0.0, max_new_tokens=64))[0]
    assert traj.termination == "context_limit"
    assert len(traj.token_ids) <= prompt_len + 120
    assert traj.messages[-1]["role"] in ("assistant", "tool")


def test_context_limit_drops_unseen_next_turn(tok):
    entry = get_entry("multi_turn_base_0")
    prompt_len = replay_calls(entry, OFFICIAL, [[]], tok).prompt_len
    backend = ScriptedBackend(tok, [["Sure."]], max_positions=prompt_len + 12)  # the reply fits, turn 1 not
    traj = run_group(backend, entry, 1, OFFICIAL, SamplingParams(temperature=0.0, max_new_tokens=8))[0]
    assert traj.termination == "context_limit" and traj.result == [[]]
    assert traj.messages[-1] == {"role": "assistant", "content": "Sure."}
    assert traj.score["error_type"] == "multi_turn:force_terminated"


def test_trajectory_roundtrip_and_validation(tok, tmp_path):
    from rcgrpo_tasks.engine.trajectory import TrajectoryError, read_trajectories, write_trajectories
    from rcgrpo_tasks.ops.inputs import InputError

    entry = get_entry("multi_turn_long_context_0")
    traj = replay_calls(entry, PAPER, entry.ground_truth, tok, reward_token="<|low_reward|>")
    path = tmp_path / "t.jsonl"
    write_trajectories(path, [traj, traj])
    back = read_trajectories(path)
    assert back[0] == traj and back[0].reward == 1.0
    row = traj.to_json()
    with pytest.raises(TrajectoryError):
        Trajectory.from_json({**row, "logprobs": row["logprobs"][:-1]})
    with pytest.raises(TrajectoryError):
        Trajectory.from_json({**row, "schema_version": 99})
    path.write_text(path.read_text() + '{"entry_id": "x"}\n')
    with pytest.raises(InputError, match="row 3"):
        read_trajectories(path)


def test_episode_state_is_isolated_per_rollout(tok):
    entry = get_entry("multi_turn_base_0")
    backend = ScriptedBackend(tok, {0: ["[mkdir(dir_name='x')]"], 1: ["[mkdir(dir_name='x')]"]})
    a, b = run_group(backend, entry, 2, PAPER, SamplingParams(temperature=0.0))
    obs = [[m["content"] for m in t.messages if m["role"] == "tool"] for t in (a, b)]
    assert obs[0] == obs[1] and "Error" not in obs[0][0]  # second rollout did not see the first one's dir


def test_rollout_cli_writes_scorable_trajectories_and_rejects_bad_input(tiny_model_dir, tmp_path):
    from typer.testing import CliRunner

    from rcgrpo_tasks.engine.trajectory import read_trajectories
    from rcgrpo_tasks.stages import rollout, score

    out = tmp_path / "t.jsonl"
    base = ["--model", str(tiny_model_dir), "--out", str(out), "--max-new-tokens", "3", "--dtype", "float32"]
    res = CliRunner().invoke(rollout.app, base + ["--ids", "multi_turn_base_1,multi_turn_miss_param_2", "--g", "1"])
    assert res.exit_code == 0, res.output
    assert [t.entry_id for t in read_trajectories(out)] == ["multi_turn_base_1", "multi_turn_miss_param_2"]
    res = CliRunner().invoke(score.app, [str(out), "-o", str(tmp_path / "scored.jsonl")])
    assert res.exit_code == 0, res.output  # a G=1 trajectory file is a BFCL result file
    out.unlink()
    for bad, needle in ((["--ids", "multi_turn_base_99999"], "unknown entry id"),
                        (["--ids", "multi_turn_base_1", "--categories", "nope"], "unknown categories"),
                        (["--ids", "multi_turn_base_1", "--adapter", str(tmp_path)], "adapter")):
        res = CliRunner().invoke(rollout.app, base + bad)
        assert res.exit_code == 2 and needle in res.output, res.output
        assert not out.exists()
