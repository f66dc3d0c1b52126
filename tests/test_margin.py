"""Does the model read its reward token: the teacher-forced margin (data.margin), its arithmetic, its shared-
prompt forward against a plain one, the token rows' distance, the paired (common random numbers) sampled arm
of the controllability check, and the margin curve of an RCTP run started from the SFT model."""

from __future__ import annotations

import json

import pytest
from helpers import HIGH, LEVELS, LOW, chat, compute_from_params, config_from_params, resolved, tiny_sft_config
from test_evaluate import _invoke, make_workdir

from rcgrpo_tasks.data import margin as mg
from rcgrpo_tasks.env.prompt import PromptConfig
from rcgrpo_tasks.env.split import PrepareDataConfig, prepare
from rcgrpo_tasks.ops.outputs import write_json, write_jsonl

TOKENS = (HIGH, LOW)


@pytest.fixture(scope="module")
def single_turn():
    """(entries, split) of the single-turn task, two categories."""
    return prepare(config_from_params(PrepareDataConfig, "prepare_data", task="single_turn", categories=("simple_python", "multiple")))


def _held_out(single_turn, n):
    from rcgrpo_tasks.env.entries import stratified

    entries, split = single_turn
    test = set(split["test"])
    return stratified([e for e in entries if e.id in test], n)


@pytest.fixture(scope="module")
def equal_rows_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with both reward tokens added and their embedding rows EXACTLY equal: a model that
    cannot read its token."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rcgrpo.tokens import add_reward_tokens

    out = tmp_path_factory.mktemp("equal_rows")
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    low, high = add_reward_tokens(model, tok, LEVELS)
    with torch.no_grad():
        model.get_input_embeddings().weight[high] = model.get_input_embeddings().weight[low]
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def test_margin_formula_on_hand_built_log_probs():
    items = [mg.Contrast("e", kind, tok, (1, 2), (0, 1)) for kind in ("expert", "dropped_call", "extra_call")
             for tok in TOKENS]
    # expert: +2 under high vs low; dropped_call: -1; extra_call: +2 (moves like the expert: margin 0)
    lps = [-1.0, -3.0, -5.0, -4.0, -2.0, -4.0]
    m = mg.per_entry_margins(items, lps, TOKENS)
    assert m == {"e": {"dropped_call": pytest.approx(3.0), "extra_call": pytest.approx(0.0)}}
    stats = mg.margin_stats({"a": {"k": 1.0, "j": 3.0}, "b": {"k": -1.0}}, n_boot=200)
    assert stats["margin"] == pytest.approx(0.5) and stats["n_entries"] == 2 and stats["share_positive"] == 0.5
    assert stats["kinds"]["k"]["margin"] == pytest.approx(0.0) and stats["kinds"]["j"]["n_entries"] == 1
    lo, hi = stats["ci"]
    assert lo == pytest.approx(-1.0) and hi == pytest.approx(2.0)
    real = mg.margin_stats({"a": {"dropped_call": 3.0, "k": 1.0}, "b": {"dropped_call": 4.0}}, n_boot=200)
    assert real["margin"] == pytest.approx(3.0)  # per entry: a mean(3, 1) = 2, b 4
    assert real["realistic"]["margin"] == pytest.approx(1.0) and real["realistic"]["n_entries"] == 1


def test_shared_prompt_forward_equals_one_forward_per_sequence(equal_rows_dir, single_turn):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(equal_rows_dir)
    model = AutoModelForCausalLM.from_pretrained(equal_rows_dir, dtype=torch.float32)
    proto = config_from_params(PromptConfig, "prompt", system_prompt="bfcl").protocol_config(1)
    items, counts = mg.contrast_set(_held_out(single_turn, 2), proto, tok, TOKENS)
    assert counts["entries"] == 2 and len(items) >= 2 * 2 * 2
    assert {c.kind for c in items} > {"expert"}
    shared = mg.sequence_logprobs(model, items)
    with torch.no_grad():
        for item, value in zip(items, shared):
            ids = torch.tensor([item.token_ids])
            lp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
            picked = lp.gather(-1, ids[0, 1:, None])[:, 0]
            expected = float((picked * torch.tensor(item.mask[1:])).sum())
            assert value == pytest.approx(expected, abs=1e-3), item.kind
    assert all(v < 0 for v in shared)


def test_margin_chunks_keep_entries_whole_within_their_tree_budget():
    """An entry's sequences share one forward (its prompt once); entries fill a chunk up to the budget of tree
    tokens; an entry over the budget is a chunk alone; the order is the items' order."""
    from rcgrpo_tasks.engine.shared_prefix import trunk_tokens

    prompt = list(range(100, 160))  # 60 shared tokens per entry, 4 answers of 10 tokens each

    def entry(e: str, system: int) -> list:  # the 4 answers differ from their first token on
        answers = [(kind, token) for kind in ("expert", "k") for token in TOKENS]
        return [mg.Contrast(e, kind, token, tuple([system] + prompt + [1000 + 10 * j + i for i in range(10)]),
                            (0,) * 61 + (1,) * 10) for j, (kind, token) in enumerate(answers)]

    items = entry("a", 1) + entry("b", 2) + entry("c", 3)
    one = trunk_tokens([list(c.token_ids) for c in entry("a", 1)])
    assert one == 61 + 4 * 10
    chunks = mg.margin_chunks(items, budget=2 * one)
    assert [[c.entry_id for c in ch] for ch in chunks] == [["a"] * 4 + ["b"] * 4, ["c"] * 4]
    assert [c for ch in chunks for c in ch] == items
    assert [len(ch) for ch in mg.margin_chunks(items, budget=one - 1)] == [4, 4, 4]  # too big: alone
    raw = sum(len(c.token_ids) for c in items)
    assert sum(trunk_tokens([list(c.token_ids) for c in ch]) for ch in chunks) == 3 * one < raw / 2


def test_a_model_that_cannot_read_its_token_has_zero_margin(equal_rows_dir, single_turn):
    """Equal rows: lp(x | high) == lp(x | low) for every answer, so every margin is 0 (while the two prompts
    differ in their reward goal, and the answers' log-probs differ from each other)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(equal_rows_dir)
    model = AutoModelForCausalLM.from_pretrained(equal_rows_dir, dtype=torch.float32)
    items, _ = mg.contrast_set(_held_out(single_turn, 3), config_from_params(PromptConfig, "prompt", system_prompt="bfcl").protocol_config(1), tok, TOKENS)
    by = {(c.entry_id, c.kind, c.token): c for c in items}
    one = next(iter(by.values()))
    assert by[(one.entry_id, one.kind, HIGH)].token_ids != by[(one.entry_id, one.kind, LOW)].token_ids
    stats = mg.teacher_forced_margin(model, items, TOKENS, n_boot=100)
    # 0 up to the float rounding of the packed forward (both tokens' branches in one sequence: ~1e-5 nat)
    assert stats["n_entries"] == 3 and abs(stats["margin"]) < 5e-5
    rows = mg.token_row_distance(model, tok, TOKENS)
    assert rows["distance"] == 0.0 and rows["median_real_distance"] > 0
    # move the high row (a seeded draw: the margin is a difference of differences, and an unseeded row can
    # land near 0 by chance): now the token can be read, every answer's log-prob moves with it, and the margin
    # moves off 0 by well over the packed forward's rounding
    with torch.no_grad():
        high = tok.convert_tokens_to_ids(HIGH)
        row = model.get_input_embeddings().weight[high]
        row.copy_(5 * torch.randn(row.shape, generator=torch.Generator().manual_seed(0)))
    logprobs = mg.sequence_logprobs(model, items)  # one forward for both checks (teacher_forced_margin's)
    lps = dict(zip(((c.entry_id, c.kind, c.token) for c in items), logprobs))
    moved = [abs(lps[(e, k, HIGH)] - lps[(e, k, LOW)]) for e, k, t in lps if t == HIGH]
    assert min(moved) > 1e-2
    assert abs(mg.margin_stats(mg.per_entry_margins(items, logprobs, TOKENS), n_boot=100)["margin"]) > 10 * 5e-5
    assert mg.token_row_distance(model, tok, TOKENS)["ratio"] > 0


def test_paired_sampled_arm_draws_the_same_seeds_under_both_tokens(equal_rows_dir, single_turn):
    """Common random numbers: for a model that cannot read its token the i-th rollout under high and under
    low are the same tokens, so every pair is identical and the gap is exactly 0."""
    from rcgrpo_tasks.engine.hf import HFBackend
    from rcgrpo_tasks.evaluation import controllability as ctl
    from rcgrpo_tasks.evaluation.accuracy import RLSampling

    backend = HFBackend(equal_rows_dir, dtype="float32", device="cpu")
    cfg = config_from_params(ctl.ControllabilityConfig, "controllability", **{"n_entries": 3, "samples_per_token": 2, "max_outputs": 1,
                                                "max_new_tokens": 6, "margin_entries": 2, "n_bootstrap": 50,
                                                "batch_rows": 8})
    entries = _held_out(single_turn, 3)
    metrics, trajs = ctl.measure(cfg, config_from_params(PromptConfig, "prompt", system_prompt="bfcl"), LEVELS, backend, entries,
                                 RLSampling(1.0, 1.0), ctl.RLGroups(4, 0.5), margin_entries=entries[:2])
    s = metrics["sampled"]
    assert s["pairs"] == 6 and s["identical_outputs"] == 6 and s["gap"] == 0.0
    assert metrics["greedy"]["identical_outputs"] == 3
    sampled = [t for t in trajs if t.provenance["arm"] == "sampled"]
    assert len({tuple(t.token_ids[t.prompt_len:]) for t in sampled}) > 1  # the seeds differ across rows
    assert metrics["margin"]["n_entries"] == 2 and abs(metrics["margin"]["margin"]) < 1e-3
    assert metrics["token_rows"]["distance"] == 0.0


def test_pair_order_keeps_each_prompt_s_rows_side_by_side():
    from rcgrpo_tasks.train.sft.rows import ordered, pair_order

    rows = [dict(chat(i, tok), entry_id=f"e{i}") for i in range(6) for tok in LEVELS]
    order = pair_order(rows, seed=0)
    assert sorted(map(json.dumps, order)) == sorted(map(json.dumps, rows))
    assert all(order[i]["entry_id"] == order[i + 1]["entry_id"] for i in range(0, 12, 2))
    assert {order[i]["reward_token"] for i in range(0, 12, 2)} == set(LEVELS)  # neither token always first
    assert order == pair_order(rows, seed=0) and order != pair_order(rows, seed=1)
    with pytest.raises(ValueError, match="row order"):
        ordered(rows, "random", 0)


def test_flat_groups_split_into_failure_and_success():
    from rcgrpo.group_metrics import flat_fractions, zero_std_fraction

    rewards = [0, 0, 0, 0] + [1, 1, 1, 1] + [1, 1, 1, 1] + [0, 1, 0, 0]
    assert flat_fractions(rewards, 4) == (0.25, 0.5)
    assert sum(flat_fractions(rewards, 4)) == zero_std_fraction(rewards, 4)


def test_rctp_from_the_sft_model_in_pairs_with_a_margin_curve(tiny_model_dir, single_turn, tmp_path):
    """init sft: the SFT adapter merged, a fresh LoRA on it, the output a plain model folder that every
    consumer loads (`load_trained`); the margin curve measured before the first step and every
    `margin_every` steps; the token rows move apart (10x their rate)."""
    from rcgrpo_tasks.engine.models import load_trained
    from rcgrpo_tasks.train.sft import config as sft_config
    from rcgrpo_tasks.train.sft import run as sft_run

    entries, split = single_turn
    write_jsonl(tmp_path / "entries.jsonl", (e.to_json() for e in entries))
    write_json(tmp_path / "split.json", split)
    write_jsonl(tmp_path / "sft.jsonl", [chat(i, None) for i in range(8)])
    write_jsonl(tmp_path / "rctp.jsonl", [dict(chat(i // 2, LEVELS[i % 2]), entry_id=f"e{i // 2}")
                                          for i in range(16)])
    first = sft_config.SftRun("sft", tiny_model_dir, tmp_path / "sft.jsonl", tmp_path / "sft", tmp_path / "ck1")
    sft_run.train_variant(tiny_sft_config(max_steps=2), LEVELS, first, track=False, compute=compute_from_params())

    cfg = tiny_sft_config(max_steps=4, batch_size=2, init="sft", row_order="pairs", margin_every=2,
                          margin_entries=2, token_lr_multiplier=10.0, require_reward_token=True)
    run = sft_config.SftRun("rctp", tiny_model_dir, tmp_path / "rctp.jsonl", tmp_path / "rctp", tmp_path / "ck2",
                          tmp_path / "m.json", init_adapter=tmp_path / "sft", entries=tmp_path / "entries.jsonl",
                          split=tmp_path / "split.json")
    summary = sft_run.train_variant(cfg, LEVELS, run, track=False, compute=compute_from_params(),
                                    prompt=config_from_params(PromptConfig, "prompt"))
    assert [p["step"] for p in summary["margin_curve"]] == [0, 2, 4]
    assert all(p["n_entries"] == 2 and p["token_rows_ratio"] >= 0 for p in summary["margin_curve"])
    assert summary["margin_curve"][-1]["token_rows_distance"] > summary["margin_curve"][0]["token_rows_distance"]
    assert (run.out / "config.json").is_file() and not (run.out / "adapter_config.json").exists()
    meta = json.loads((run.out / sft_run.META_FILE).read_text())
    assert meta["merged"] and meta["init_adapter"] == str(tmp_path / "sft")
    model, tok = load_trained(tiny_model_dir, run.out)
    assert all(len(tok(t, add_special_tokens=False)["input_ids"]) == 1 for t in LEVELS)
    assert not hasattr(model, "peft_config")

    with pytest.raises(Exception, match="init-adapter"):
        sft_run.train_variant(cfg, LEVELS, sft_config.SftRun("rctp", tiny_model_dir, tmp_path / "rctp.jsonl",
                                                       tmp_path / "x", tmp_path / "ck3"), track=False, compute=compute_from_params())


def test_the_margin_curve_reads_dev_entries_never_held_out_ones(single_turn, tmp_path):
    """RCTP's step count is chosen on its margin curve: the curve's entries come from the dev side."""
    from rcgrpo_tasks.env.prompt import PromptConfig
    from rcgrpo_tasks.ops.inputs import InputError
    from rcgrpo_tasks.train.sft.margin_curve import margin_curve

    entries, split = single_turn
    write_jsonl(tmp_path / "entries.jsonl", (e.to_json() for e in entries))
    write_json(tmp_path / "split.json", split)
    curve = margin_curve(tmp_path / "entries.jsonl", tmp_path / "split.json", 6, config_from_params(PromptConfig, "prompt"), LEVELS, 2, False)
    ids = {e.id for e in curve.entries}
    assert len(ids) == 6 and ids <= set(split["dev"]) and not ids & set(split["test"])
    write_json(tmp_path / "split.json", {**split, "dev": []})
    with pytest.raises(InputError, match="dev side is empty"):
        margin_curve(tmp_path / "entries.jsonl", tmp_path / "split.json", 6, config_from_params(PromptConfig, "prompt"), LEVELS, 2, False)


def test_pairs_share_a_micro_batch_in_the_trainer_s_own_dataloader(tiny_model_dir, tmp_path):
    """row_order pairs: the dataset order is kept (no random sampler), so each micro-batch of 2 is one
    prompt under its two goals; balanced: the sampler shuffles."""
    from rcgrpo_tasks.train.sft import trainer as sft_trainer
    from rcgrpo_tasks.train.sft.rows import ordered

    rows = [dict(chat(i // 2, LEVELS[i % 2]), entry_id=f"e{i // 2}") for i in range(16)]
    for order, kept in (("pairs", True), ("balanced", False)):
        cfg = tiny_sft_config(max_steps=1, batch_size=2, row_order=order)
        trainer = sft_trainer.build_trainer(resolved(cfg), tiny_model_dir, ordered(rows, order, 0), LEVELS,
                                            tmp_path / order)
        tok = trainer.processing_class
        assert trainer.keep_order is kept
        batches = [[tok.decode(ids) for ids in b["input_ids"]] for b in trainer.get_train_dataloader()]
        same = [b[0].split("[Reward Goal")[0] == b[1].split("[Reward Goal")[0] for b in batches]
        if kept:
            assert len(batches) == 8 and all(same)
            assert all(len({HIGH in t for t in b}) == 2 for b in batches)
        else:
            assert not all(same)


def test_config_checks():
    with pytest.raises(ValueError, match="row_order"):
        tiny_sft_config(row_order="paired")
    with pytest.raises(ValueError, match=r"sft.init: expected .*'base', 'sft'"):
        tiny_sft_config(init="rctp")
    with pytest.raises(ValueError, match="margin_every"):
        tiny_sft_config(margin_every=-1)


def test_rl_pool_is_rl_prompts_in_the_inits_success_band(single_turn, tmp_path):
    """RL samples the split's rl side (prompts no fine-tuning set holds), its pool the prompts whose share of
    the init's own samples that succeed lies in rl.pool_band, plus always-solved ones up to
    rl.pool_solved_share of the pool (a seeded draw); unsampled prompts are out; without the samples, or with
    too few prompts left, it refuses; without an rl side it samples train."""
    from rcgrpo_tasks.data.onpolicy import sampled_success_rates
    from rcgrpo_tasks.ops.config import ConfigError
    from rcgrpo_tasks.train.rl import config as rl_config
    from rcgrpo_tasks.train.rl import pool as rl_pool

    entries, split = single_turn
    rl, train = split["train"][:7], split["train"][7:]
    write_jsonl(tmp_path / "entries.jsonl", (e.to_json() for e in entries))
    write_json(tmp_path / "split.json", {**split, "train": train, "rl": rl})
    rows = [{"entry_id": e, "provenance": {"reward": float(i < k)}} for e, k in zip(rl, (4, 3, 2, 1, 0, 4, 4))
            for i in range(4)]  # rl[6] never sampled below: it is left out
    rates = sampled_success_rates(rows[:24])
    assert rates == {rl[0]: 1.0, rl[1]: 0.75, rl[2]: 0.5, rl[3]: 0.25, rl[4]: 0.0, rl[5]: 1.0}
    proto = config_from_params(PromptConfig, "prompt", system_prompt="bfcl").protocol_config(1)

    def pick(**kw):
        cfg = config_from_params(rl_config.RLConfig, "rl", **{"num_generations": 2, "batch_size": 2, "micro_batch_size": 2,
                                        "max_entries": None, **kw})
        return sorted(e.id for e in rl_pool.train_entries(tmp_path / "entries.jsonl", tmp_path / "split.json", cfg,
                                                         proto, success=rates))

    assert pick() == sorted(rl[1:4])  # the default band [0.25, 0.75]
    with_solved = pick(pool_solved_share=0.25)  # one always-solved prompt per three of the band's
    assert set(with_solved) - set(rl[1:4]) <= {rl[0], rl[5]} and len(with_solved) == 4
    assert pick(pool_solved_share=0.6) == sorted(rl[:4] + [rl[5]])  # no more than there are
    assert pick(pool_band=None) == sorted(rl)  # every prompt of the side, sampled or not
    assert rl_pool.pool_ids({"a": 1.0, "b": 0.5}, (0.5, 1.0), 0.5, 0) == ["a", "b"]  # in the band: not an extra
    cfg = config_from_params(rl_config.RLConfig, "rl", **{"num_generations": 2, "batch_size": 2, "micro_batch_size": 2})
    with pytest.raises(ConfigError, match="--pool"):
        rl_pool.train_entries(tmp_path / "entries.jsonl", tmp_path / "split.json", cfg, proto)
    strict = config_from_params(rl_config.RLConfig, "rl", **{"num_generations": 2, "batch_size": 8, "micro_batch_size": 2,
                                       "max_entries": None})
    with pytest.raises(ConfigError, match="need at least 4"):
        rl_pool.train_entries(tmp_path / "entries.jsonl", tmp_path / "split.json", strict, proto, success=rates)
    for bad in ({"pool_band": [0.8, 0.2]}, {"pool_band": [0.1, 1.5]}, {"pool_solved_share": 1.0}):
        with pytest.raises(ConfigError, match="pool_"):
            config_from_params(rl_config.RLConfig, "rl", **bad)
    with pytest.raises(ConfigError, match="rl.pool_band"):
        config_from_params(rl_config.RLConfig, "rl", **{"min_sampled_success": 0.25}, where="p.yaml:rl")
    write_json(tmp_path / "split.json", {k: v for k, v in split.items() if k != "rl"})  # no rl side: train
    assert rl_pool.rl_side(tmp_path / "split.json") == "train"


def test_divergent_loss_keeps_only_what_follows_the_parting(tiny_model_dir):
    """loss_on divergent: a pair's shared answer prefix leaves the loss in both rows, its tails stay; a row
    without a partner keeps every assistant token."""
    from transformers import AutoTokenizer

    from rcgrpo.goal import format_goal
    from rcgrpo_tasks.train.sft.rows import tokenize_rows

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.add_special_tokens({"extra_special_tokens": list(LEVELS)})

    def row(entry, token, answer):
        return {"entry_id": entry, "reward_token": token, "messages": [
            {"role": "user", "content": "Add 2 and 3." + format_goal(token)},
            {"role": "assistant", "content": answer}]}

    rows = [row("p", HIGH, "[add(a=2, b=3)]"), row("p", LOW, "[add(a=2, b=4)]"), row("q", HIGH, "[add(a=1, b=1)]")]
    full, _ = tokenize_rows(rows, tok, 512)
    div, stats = tokenize_rows(rows, tok, 512, loss_on="divergent")
    kept = [tok.decode([i for i, m in zip(r["input_ids"], r["assistant_masks"]) if m]) for r in div]
    assert kept[0].startswith("3") and kept[1].startswith("4") and "add(a=2" not in kept[0] + kept[1]
    assert div[2] == full[2] and stats["shared_tokens_masked"] > 0
    assert sum(div[0]["assistant_masks"]) < sum(full[0]["assistant_masks"])
    with pytest.raises(ValueError, match="loss_on"):
        tokenize_rows(rows, tok, 512, loss_on="suffix")


def test_evaluate_measures_the_margin_of_a_conditioned_model_unless_told_not_to(equal_rows_dir, tmp_path,
                                                                                monkeypatch):
    """`evaluate --no-margin`: the RCTP model's margin is the controllability stage's; evaluate skips it."""
    from rcgrpo_tasks.ops.inputs import read_json

    work = make_workdir(tmp_path, monkeypatch)
    for extra, wanted in (((), True), (("--no-margin",), False)):
        res = _invoke(work, equal_rows_dir, "--reward-token", "<|high_reward|>", *extra)
        assert res.exit_code == 0, res.output
        metrics = read_json(work / "out" / "metrics.json")
        assert ("margin" in metrics) is wanted and ("token_rows" in metrics) is wanted
