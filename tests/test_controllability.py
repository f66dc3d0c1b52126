"""controllability stage: the gap statistic and its bootstrap CI, the zero-variance formula on hand-built
rates (against brute-force enumeration), a token-obedient scripted policy (gap = its success rate, in both
arms), and the CLI on a tiny model trained by the sft stage (real engine, real scorer, temp MLflow)."""

from __future__ import annotations

import itertools
import json
import math
from types import SimpleNamespace

import pytest
import yaml
from helpers import HIGH, LEVELS, LOW, compute_from_params, config_from_params, write_params

from rcgrpo_tasks.env.multi_turn import entries as multi_turn
from rcgrpo_tasks.evaluation import controllability as ctl
from rcgrpo_tasks.evaluation.accuracy import RLSampling
from rcgrpo_tasks.ops.config import ConfigError, load_keys
from rcgrpo_tasks.ops.inputs import InputError
from rcgrpo_tasks.ops.outputs import write_json, write_jsonl
from rcgrpo_tasks.stages import controllability as ctl_stage

RL = {"temperature": 1.0, "top_p": 1.0, "num_generations": 4, "p_high": 0.5, "learning_rate": 1e-5}


def _scores(rows):
    return [{"entry_id": e, "reward_token": t, "r": r} for e, t, r in rows]


def test_gap_stats_pairs_by_entry():
    scores = _scores([("a", HIGH, 1), ("a", LOW, 0), ("b", HIGH, 1), ("b", LOW, 1), ("c", HIGH, 0), ("c", LOW, 0),
                      ("d", HIGH, 1)])  # d has no low rollout: in the means, not in the paired gap
    s = ctl.gap_stats(scores, HIGH, LOW, "r")
    assert s["high"] == pytest.approx(3 / 4) and s["low"] == pytest.approx(1 / 3)
    assert s["gap"] == pytest.approx(1 / 3)
    assert s["gap_se"] == pytest.approx(math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2 / 3))
    lo, hi = s["gap_ci"]
    assert lo == 0.0 and hi == 1.0  # resamples of {1, 0, 0}: every mean from 0 to 1 occurs


def test_gap_ci_over_entries_of_sampled_means():
    """Several samples per token: the unit is the entry (per-entry means), and the CI tightens with entries."""
    rows = []
    for i in range(40):  # every entry: high 2/2 successes, low 1/2 -> per-entry gap 0.5 exactly
        rows += [(f"e{i}", HIGH, 1), (f"e{i}", HIGH, 1), (f"e{i}", LOW, 1), (f"e{i}", LOW, 0)]
    s = ctl.gap_stats(_scores(rows), HIGH, LOW, "r")
    assert s["gap"] == pytest.approx(0.5) and s["gap_ci"] == [pytest.approx(0.5), pytest.approx(0.5)]
    noisy = [(f"e{i}", t, r) for i in range(40) for t, r in ((HIGH, i % 2), (LOW, 0))]  # gaps 0, 1, 0, 1, ...
    s = ctl.gap_stats(_scores(noisy), HIGH, LOW, "r", n_boot=500)
    lo, hi = s["gap_ci"]
    assert s["gap"] == pytest.approx(0.5) and 0.25 < lo < 0.5 < hi < 0.75
    assert ctl.gap_stats(_scores(noisy), HIGH, LOW, "r", n_boot=500) == s  # seeded: reproducible


def _brute_force(p_h: float, p_l: float, g: int, q: float) -> float:
    """P(all G rewards equal) by enumerating every (token, outcome) assignment of the G rollouts."""
    total = 0.0
    for tokens in itertools.product((1, 0), repeat=g):
        p_tok = math.prod(q if t else 1 - q for t in tokens)
        for outcome in ((1,) * g, (0,) * g):
            total += p_tok * math.prod((p_h if t else p_l) if o else 1 - (p_h if t else p_l)
                                       for t, o in zip(tokens, outcome))
    return total


@pytest.mark.parametrize("p_h,p_l,g,q", [(1.0, 0.0, 2, 0.5), (0.7, 0.2, 5, 0.5), (0.9, 0.9, 4, 0.3),
                                         (0.0, 0.0, 3, 0.5), (0.5, 0.1, 1, 0.5)])
def test_zero_variance_share_exact(p_h, p_l, g, q):
    all_high, mixed = ctl.zero_variance_share(p_h, p_l, g, q)
    assert all_high == pytest.approx(p_h ** g + (1 - p_h) ** g)
    assert mixed == pytest.approx(_brute_force(p_h, p_l, g, q))
    m = q * p_h + (1 - q) * p_l  # the binomial theorem's closed form
    assert mixed == pytest.approx(m ** g + (1 - m) ** g)


def test_zero_variance_share_hand_built():
    # A perfectly obedient entry: all-high groups always succeed (no signal); mixed G=2 groups are
    # uniform only when both tokens match (1/2).
    assert ctl.zero_variance_share(1.0, 0.0, 2, 0.5) == (1.0, 0.5)
    # A token-blind entry: the tokens change nothing.
    a, m = ctl.zero_variance_share(0.3, 0.3, 5, 0.5)
    assert a == pytest.approx(m) == pytest.approx(0.3 ** 5 + 0.7 ** 5)
    z = ctl.zero_variance_stats([1.0, 0.3], [0.0, 0.3], g=2, q=0.5, n_boot=200)
    assert z["all_high"] == pytest.approx((1.0 + 0.58) / 2) and z["mixed"] == pytest.approx((0.5 + 0.58) / 2)
    assert z["mixed_minus_all_high"] == pytest.approx(-0.25)
    lo, hi = z["mixed_minus_all_high_ci"]
    assert lo == pytest.approx(-0.5) and hi == pytest.approx(0.0)


def test_sampled_arm_takes_rl_sampling_and_refuses_its_own(tmp_path):
    """The sampled arm samples at rl.temperature / rl.top_p, read key by key from `rl` (its other keys left
    aside); the section cannot set them (moved keys)."""
    (tmp_path / "p.yaml").write_text(yaml.safe_dump({"rl": {**RL, "temperature": 0.7, "top_p": 0.9}}))
    rl, groups = load_keys(RLSampling, tmp_path / "p.yaml", "rl"), load_keys(ctl.RLGroups, tmp_path / "p.yaml", "rl")
    cfg = config_from_params(ctl.ControllabilityConfig, "controllability", **{"max_new_tokens": 12}, where="p.yaml:controllability").sampled_as(rl)
    assert (cfg.decode.temperature, cfg.decode.top_p, cfg.decode.max_new_tokens) == (0.7, 0.9, 12)
    assert ctl.rl_record(rl, groups) == {"temperature": 0.7, "top_p": 0.9, "num_generations": 4, "p_high": 0.5}
    (tmp_path / "p.yaml").write_text(yaml.safe_dump({"rl": {"temperature": 0.0, "top_p": 0.9}}))
    with pytest.raises(ConfigError, match="temperature > 0"):
        load_keys(RLSampling, tmp_path / "p.yaml", "rl")
    with pytest.raises(ConfigError, match=r"rl: missing key\(s\) \['num_generations', 'p_high'\]"):
        load_keys(ctl.RLGroups, tmp_path / "p.yaml", "rl")
    with pytest.raises(ConfigError, match=r"controllability.temperature: this key moved: rl.temperature"):
        config_from_params(ctl.ControllabilityConfig, "controllability", **{"temperature": 1.0}, where="p.yaml:controllability")
    with pytest.raises(ConfigError, match="batch_rows"):
        config_from_params(ctl.ControllabilityConfig, "controllability", **{"batch_rows": 1}, where="p.yaml:controllability")


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(tiny_model_dir)
    t.add_special_tokens({"extra_special_tokens": [LOW, HIGH]})
    return t


@pytest.mark.parametrize("protocol", ["paper", "official"])
def test_obedient_policy_has_full_gap(tok, protocol):
    """A policy that replays the gold calls only when asked for a high reward: gap = 1 on entries whose gold
    replay succeeds, and the low-conditioned rollouts score 0. (Partial credit is per BFCL turn, so only the
    official protocol, turn by turn, can earn it.)"""
    from rcgrpo_tasks.engine.backend import ScriptedBackend
    from rcgrpo_tasks.engine.rollout import replay_steps
    from rcgrpo_tasks.env.prompt import PromptConfig

    entries = multi_turn.load_entries(["base"])[:2]
    cfg = config_from_params(ctl.ControllabilityConfig, "controllability", **{"n_entries": 2, "max_outputs": 20, "max_new_tokens": 4000,
                                                "samples_per_token": 2, "batch_rows": 8,
                                                "margin": False})  # a scripted policy has no log-probs
    prompt = config_from_params(PromptConfig, "prompt", protocol=protocol, doc_style="compact", system_prompt="bfcl")
    proto = prompt.protocol_config(20) if protocol == "paper" else config_from_params(PromptConfig, "prompt", protocol=protocol, system_prompt="bfcl").protocol_config(20)
    gold = {e.id: replay_steps(e, proto, e.ground_truth) for e in entries}
    high_id = tok.convert_tokens_to_ids(HIGH)
    starts: dict = {}

    def policy(key, step, ids):
        if step == 0:  # keys restart in every session: find the entry from the prompt at each start
            starts[key] = next(e.id for e in entries if e.turns[0][0]["content"][:40] in tok.decode(ids))
        entry_id = starts[key]
        texts = gold[entry_id] if high_id in ids else []
        return texts[step] if step < len(texts) else ""

    backend = ScriptedBackend(tok, policy)
    metrics, trajs = ctl.measure(cfg, prompt, LEVELS, backend, entries, RLSampling(1.0, 1.0), ctl.RLGroups(4, 0.5))
    # greedy arm (1 per token) then the sampled arm (2 per token), each high first per entry
    assert [t.reward_token for t in trajs] == [HIGH, LOW] * 2 + [HIGH, HIGH, LOW, LOW] * 2
    assert [t.provenance["arm"] for t in trajs] == ["greedy"] * 4 + ["sampled"] * 8
    for name in ("greedy", "sampled"):
        arm = metrics[name]
        assert arm["success_rate_high"] == 1.0 and arm["success_rate_low"] == 0.0
        assert arm["gap"] == 1.0 and arm["gap_ci"] == [1.0, 1.0]
        assert arm["partial_credit_gap"] == (1.0 if protocol == "official" else 0.0)
    assert metrics["sampled"]["samples_per_token"] == 2 and metrics["sampled"]["temperature"] == 1.0
    assert metrics["greedy"]["identical_outputs"] == 0 and metrics["sampled"]["identical_outputs"] == 0
    assert metrics["sampled"]["pairs"] == 4 and "margin" not in metrics
    premise = metrics["sampled"]["premise"]  # every high success fails under low: q = 1, the gate passes
    assert premise["q"] == 1.0 and premise["high_only"] == 4 and premise["low_only"] == 0
    # what the low side's failures are made of: it answers nothing, so no call; q is all of that kind
    sampled = metrics["sampled"]
    assert sampled["failures_low"] == {"no_call": 4, "wrong_function": 0, "wrong_arguments": 0}
    assert sum(sampled["failures_high"].values()) == 0 and sampled["high_successes"] == 4
    assert sampled["q_by_kind"] == {"no_call": 1.0, "wrong_function": 0.0, "wrong_arguments": 0.0}
    assert sampled["per_entry"] == {e.id: [1.0, 0.0] for e in entries}
    assert metrics["premise_gate"]["passed"] and metrics["premise_gate"]["min_q"] == cfg.premise_min_q
    # p_h = 1, p_l = 0: all-high groups never vary; mixed G=4 groups only when all 4 tokens agree (2 / 16).
    z = metrics["zero_variance"]
    assert z["all_high"] == 1.0 and z["mixed"] == pytest.approx(0.125) and z["G"] == 4
    assert metrics["entries"] == [e.id for e in entries]


def test_q_counts_paired_rollouts_and_its_interval_resamples_entries():
    """q = P(low fails | high succeeds) over pairs (same entry, same row seed); the discordant pairs behind the
    gap and their exact McNemar p; the interval from resampled entries, NaN-free unless no high success is left."""
    pairs = {"a": [(1, 0), (1, 0), (0, 0)], "b": [(1, 1), (0, 1), (1, 0)], "c": [(0, 0), (0, 0), (0, 0)]}
    q = ctl.q_stats(pairs, n_boot=500)
    assert q["q"] == pytest.approx(3 / 4) and (q["high_successes"], q["high_only"], q["low_only"]) == (4, 3, 1)
    assert q["pairs"] == 9 and q["mcnemar_p"] == pytest.approx(0.625)
    assert 0.0 <= q["q_ci"][0] <= 0.75 <= q["q_ci"][1] <= 1.0
    none = ctl.q_stats({"a": [(0, 0), (0, 1)]}, n_boot=100)
    assert math.isnan(none["q"]) and all(math.isnan(x) for x in none["q_ci"])


@pytest.mark.parametrize("q,low,passed,why", [(0.4, 0.02, True, "met"), (0.2, 0.02, False, "q 0.200 < 0.3"),
                                               (0.5, 0.0, False, "CI low"), (float("nan"), -0.1, False, "q nan")])
def test_the_premise_gate_needs_q_and_a_gap_above_zero(q, low, passed, why):
    gate = ctl.premise_gate({"premise": {"q": q}, "gap_ci": [low, 0.3]}, 0.3)
    assert gate["passed"] is passed and why in gate["why"]


def test_cli_on_tiny_rctp_model(tiny_model_dir, tmp_path, monkeypatch):
    """End to end on a tiny sft-stage output: loads through sft.load_trained, rolls, writes, logs."""
    from typer.testing import CliRunner

    from rcgrpo_tasks.train.sft import run as sft_run
    from rcgrpo_tasks.train.sft.config import SftConfig, SftRun

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    monkeypatch.setenv("MLFLOW_ARTIFACT_ROOT", str(tmp_path / "mlartifacts"))
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "test-ctl")
    monkeypatch.delenv("RCGRPO_PARENT_RUN_ID", raising=False)
    from test_sft import chat  # the hand-made rctp rows

    write_jsonl(tmp_path / "rctp.jsonl", [chat(i, HIGH if i % 2 else LOW) for i in range(8)])
    cfg = config_from_params(SftConfig, "sft", learning_rate=1e-2, max_steps=1, batch_size=4, max_length=128, lora_r=4, lora_alpha=8,
                    log_model=False, require_reward_token=True, reward_token_init="apart", grad_accum=1)
    spec = SftRun("rctp", tiny_model_dir, tmp_path / "rctp.jsonl", tmp_path / "adapter", tmp_path / "ck")
    sft_run.train_variant(cfg, LEVELS, spec, track=False, compute=compute_from_params())

    entries = multi_turn.load_entries(["base"])[:3]
    write_jsonl(tmp_path / "entries.jsonl", (e.to_json() for e in entries))
    write_json(tmp_path / "split.json", {"train": [entries[0].id], "test": [e.id for e in entries[1:]]})
    write_params(tmp_path / "params.yaml", {
        "controllability": {"n_entries": 2, "samples_per_token": 2, "max_outputs": 1, "max_new_tokens": 3,
                            "dtype": "float32", "n_bootstrap": 50, "guidance": 4.0, "batch_rows": 8},
        "prompt": {"system_prompt": "short"}, "rl": RL,
        "label_rewards": {"tokens": list(LEVELS)}})
    res = CliRunner().invoke(ctl_stage.app, [
        "--model-dir", str(tiny_model_dir), "--adapter-dir", str(tmp_path / "adapter"),
        "--entries", str(tmp_path / "entries.jsonl"), "--split", str(tmp_path / "split.json"),
        "--metrics", str(tmp_path / "m.json"), "--trajectories", str(tmp_path / "t.jsonl"),
        "--params", str(tmp_path / "params.yaml")])
    assert res.exit_code == 0, res.output
    m = json.loads((tmp_path / "m.json").read_text())
    assert m["entries"] == [e.id for e in entries[1:]] and m["n_entries"] == 2 and m["side"] == "test"
    for arm in ("greedy", "sampled", "guided"):
        lo, hi = m[arm]["gap_ci"]
        assert 0.0 <= m[arm]["success_rate_high"] <= 1.0 and -1.0 <= lo <= m[arm]["gap"] <= hi <= 1.0
    assert m["sampled"]["temperature"] == RL["temperature"] and m["zero_variance"]["G"] == RL["num_generations"]
    assert 0.0 <= m["zero_variance"]["all_high"] <= 1.0 and 0 <= m["greedy"]["identical_outputs"] <= 2
    # the teacher-forced margin on every held-out entry (2 here: margin_entries null), multi-turn near misses
    assert m["margin"]["n_entries"] == 2 and m["margin"]["kinds"] and m["token_rows"]["ratio"] > 0
    assert m["sampled"]["pairs"] == 4 and 0 <= m["sampled"]["identical_outputs"] <= 4
    rows = [json.loads(r) for r in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert [r["reward_token"] for r in rows] == [HIGH, LOW] * 2 + [HIGH, HIGH, LOW, LOW] * 4
    sampled = [r["provenance"]["sampling"]["temperature"] for r in rows if r["provenance"]["arm"] == "sampled"]
    assert sampled == [RL["temperature"]] * 8
    # the guided arm: same seeds and temperature, guidance recorded; its log-probs are the guided distribution's
    # (on this random tiny model the token's logit effect is ~1 % of their spread, so the tokens may agree)
    guided = [r for r in rows if r["provenance"]["arm"] == "guided"]
    assert m["guided"]["guidance"] == 4.0 and len(guided) == 8
    assert {r["provenance"]["guidance"] for r in guided} == {4.0}
    unguided = [r["logprobs"] for r in rows if r["provenance"]["arm"] == "sampled"]
    assert [r["logprobs"] for r in guided] != unguided
    q = m["sampled"]["q_by_kind"]
    assert all(math.isnan(v) for v in q.values()) if not m["sampled"]["high_successes"] else \
        sum(q.values()) == pytest.approx(m["sampled"]["premise"]["q"])
    assert m["cell"] == "rctp" and set(m["sampled"]["per_entry"]) <= set(m["entries"])


def test_the_premise_after_rl_is_the_same_check_named_as_its_stage(tmp_path, monkeypatch):
    """`--cell rctp-<algo>`: the check on an RL cell's policy, its MLflow run named as its DVC stage."""
    import mlflow
    from typer.testing import CliRunner

    seen = {}
    backend = SimpleNamespace(describe=lambda: {"device": "cpu"})
    monkeypatch.setattr(ctl_stage, "load_policy", lambda *a, **k: backend)
    monkeypatch.setattr(ctl_stage, "measure", lambda *a, **k: (seen.setdefault("m", {**_FAKE}), []))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "test-ctl-rl")
    monkeypatch.delenv("RCGRPO_PARENT_RUN_ID", raising=False)
    entries = multi_turn.load_entries(["base"])[:3]
    write_jsonl(tmp_path / "entries.jsonl", (e.to_json() for e in entries))
    write_json(tmp_path / "split.json", {"train": [entries[0].id], "test": [e.id for e in entries[1:]]})
    write_params(tmp_path / "params.yaml", {"controllability": {"n_entries": 2, "margin": False}, "rl": RL,
                                            "label_rewards": {"tokens": list(LEVELS)}})
    (tmp_path / "model").mkdir()
    res = CliRunner().invoke(ctl_stage.app, [
        "--model-dir", str(tmp_path / "model"), "--cell", "rctp-rc_frozen", "--grid-seed", "2",
        "--entries", str(tmp_path / "entries.jsonl"), "--split", str(tmp_path / "split.json"),
        "--metrics", str(tmp_path / "m.json"), "--params", str(tmp_path / "params.yaml")])
    assert res.exit_code == 0, res.output
    m = json.loads((tmp_path / "m.json").read_text())
    assert m["cell"] == "rctp-rc_frozen" and m["grid_seed"] == 2
    run, = mlflow.search_runs(experiment_names=["test-ctl-rl"], output_format="list")
    assert run.info.run_name == "controllability_rl_rctp@2-rc_frozen"
    assert run.data.tags["rcgrpo.cell"] == "rctp-rc_frozen"


_FAKE = {"n_entries": 2, "rollout_s": 0.0, "premise_gate": {"min_q": 0.3, "passed": True, "why": "met"},
         "sampled": {"temperature": 0.7, "samples_per_token": 1, "success_rate_high": 0.5, "success_rate_low": 0.0,
                     "gap": 0.5, "gap_ci": [0.1, 0.9], "identical_outputs": 0, "pairs": 2,
                     "premise": {"q": 1.0, "q_ci": [1.0, 1.0], "high_only": 1, "low_only": 0, "mcnemar_p": 1.0}},
         "zero_variance": {"G": 4, "all_high": 0.5, "mixed": 0.4}}


def test_entries_come_from_the_side_asked_for(tmp_path):
    """Designs are chosen on dev: `--side dev` takes dev entries only, in the stratified order; a bad side or an
    empty dev side is a clear error."""
    entries = multi_turn.load_entries(["base"])[:5]
    write_jsonl(tmp_path / "entries.jsonl", (e.to_json() for e in entries))
    ids = [e.id for e in entries]
    write_json(tmp_path / "split.json", {"train": ids[:1], "dev": ids[1:3], "test": ids[3:]})
    cfg = config_from_params(ctl.ControllabilityConfig, "controllability", **{"n_entries": 8})
    paths = (tmp_path / "entries.jsonl", tmp_path / "split.json")
    assert [e.id for e in ctl.held_out_entries(*paths, cfg, side="dev")] == ids[1:3]
    assert [e.id for e in ctl.held_out_entries(*paths, cfg)] == ids[3:]
    with pytest.raises(InputError, match="side must be test or dev"):
        ctl.held_out_entries(*paths, cfg, side="train")
    write_json(tmp_path / "split.json", {"train": ids[:1], "dev": [], "test": ids[1:]})
    with pytest.raises(InputError, match="the dev side is empty"):
        ctl.held_out_entries(*paths, cfg, side="dev")


def test_bad_params_and_missing_split(tmp_path):
    from typer.testing import CliRunner

    write_params(tmp_path / "params.yaml", {"controllability": {"n_entries": 0}})
    res = CliRunner().invoke(ctl_stage.app, ["--params", str(tmp_path / "params.yaml")])
    assert res.exit_code == 2 and "n_entries" in res.output
    write_params(tmp_path / "params.yaml", {"controllability": {}, "prompt": {"system_prompt": "bfcl"}, "rl": None})
    res = CliRunner().invoke(ctl_stage.app, ["--params", str(tmp_path / "params.yaml")])
    assert res.exit_code == 2 and "rl: missing key(s) ['temperature', 'top_p']" in res.output  # sampled as RL samples
    write_params(tmp_path / "params.yaml", {"controllability": {}, "prompt": {"system_prompt": "bfcl"}, "rl": RL})
    res = CliRunner().invoke(ctl_stage.app, ["--params", str(tmp_path / "params.yaml"), "--split",
                                       str(tmp_path / "none.json"), "--entries", str(tmp_path / "e.jsonl")])
    assert res.exit_code == 2 and ("not found" in res.output)


@pytest.mark.parametrize("adapter,match", [("missing", "no adapter_config.json"), ("", "is not a single token")])
def test_bad_model_fails_before_any_run_and_writes_nothing(tiny_model_dir, tmp_path, monkeypatch, adapter, match):
    """A missing adapter, or a model without the reward tokens: exit 2 naming the folder, no outputs, no MLflow run."""
    from typer.testing import CliRunner

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    entries = multi_turn.load_entries(["base"])[:2]
    write_jsonl(tmp_path / "entries.jsonl", (e.to_json() for e in entries))
    write_json(tmp_path / "split.json", {"train": [entries[0].id], "test": [entries[1].id]})
    write_params(tmp_path / "params.yaml", {"controllability": {"n_entries": 1, "dtype": "float32"},
                                                          "prompt": {"system_prompt": "bfcl"}, "rl": RL})
    res = CliRunner().invoke(ctl_stage.app, [
        "--model-dir", str(tiny_model_dir), *(["--adapter-dir", str(tmp_path / adapter)] if adapter else []),
        "--entries", str(tmp_path / "entries.jsonl"), "--split", str(tmp_path / "split.json"),
        "--metrics", str(tmp_path / "m.json"), "--trajectories", str(tmp_path / "t.jsonl"),
        "--params", str(tmp_path / "params.yaml")])
    assert res.exit_code == 2 and match in res.output, res.output
    assert not (tmp_path / "m.json").exists() and not (tmp_path / "t.jsonl").exists()
    assert not (tmp_path / "mlflow.db").exists()


def test_report_table_carries_the_controllability_columns(tmp_path):
    """report --controllability rctp=metrics.json: the RCTP row gets both gaps with CIs and the shares."""
    from rcgrpo_tasks.evaluation.report_tables import controllability_table
    from rcgrpo_tasks.evaluation.results_table import build_report

    for label in ("sft", "rctp"):
        write_jsonl(tmp_path / label / "results.jsonl", [
            {"id": f"multi_turn_base_{i}", "category": "base", "valid": i == 0, "paper_reward": float(i == 0),
             "partial_credit": 0.0} for i in range(3)])
        write_json(tmp_path / label / "metrics.json", {"settings": {"side": "test"}})
    ctl_json = {"sampled": {"gap": 0.25, "gap_ci": [0.05, 0.5]}, "greedy": {"gap": 0.0, "gap_ci": [0.0, 0.0]},
                "zero_variance": {"G": 5, "all_high": 0.92, "mixed": 0.61}}
    write_json(tmp_path / "ctl.json", ctl_json)
    rows = build_report([("sft", tmp_path / "sft"), ("rctp", tmp_path / "rctp")], [], 0,
                        [("rctp", tmp_path / "ctl.json")])
    table = controllability_table(rows)
    rctp_line = next(line for line in table.splitlines() if line.startswith("| RCTP"))
    assert "sampled gap" in table and not any(line.startswith("| SFT") for line in table.splitlines())
    assert "+0.250 [+0.050, +0.500]" in rctp_line and "+0.000 [no spread: no interval]" in rctp_line  # never a point
    assert "0.920 / 0.610 (G=5)" in rctp_line and rctp_line.startswith("| RCTP | n/a | n/a |")
    with pytest.raises(InputError, match="controllability metrics not found"):
        build_report([("rctp", tmp_path / "rctp")], [], 0, [("rctp", tmp_path / "none.json")])
