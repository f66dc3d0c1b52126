"""Backends: the hf session's KV reuse is exact, adapters load (or fail clearly), vllm is guarded."""

from __future__ import annotations

import json

import pytest

from rcgrpo_tasks.engine.backend import SamplingParams, ScriptedBackend
from rcgrpo_tasks.engine.backend_registry import load_backend
from rcgrpo_tasks.engine.hf import HFBackend
from rcgrpo_tasks.engine.models import ModelLoadError
from rcgrpo_tasks.engine.prefix_layout import prefix_tree, walk
from rcgrpo_tasks.engine.sampling import sample_tokens
from rcgrpo_tasks.engine.vllm import VLLMBackend


def _check(model, prompts, outs, temperature=1.0):
    import torch

    for p, o in zip(prompts, outs):
        with torch.no_grad():
            logits = model(torch.tensor([list(p) + o.token_ids], device=model.device)).logits[0].float().cpu()
        logp = torch.log_softmax(logits / (temperature or 1.0), -1)
        fresh = [logp[len(p) - 1 + j, t].item() for j, t in enumerate(o.token_ids)]
        assert max(abs(a - b) for a, b in zip(fresh, o.logprobs)) < 1e-4


def test_session_reuse_reorder_drop_and_compaction(backend):
    sess = backend.session()
    sess.PREFILL_CHUNK, sess.COMPACT_AT, sess.COMPACT_MIN = 4, 0.01, 8  # force chunking and compaction
    widths = []
    compact = sess._maybe_compact

    def recording():
        before = sess.cache.n
        compact()
        widths.append((before, sess.cache.n))

    sess._maybe_compact = recording
    sp = SamplingParams(temperature=1.0, max_new_tokens=7, seed=3)
    seqs = {"a": [5, 6, 7, 8, 9, 10, 11], "b": [5, 6, 7, 8, 12], "c": [5, 6, 7, 8, 9, 10, 13, 14, 15]}
    keys = ["a", "b", "c"]
    outs = sess.generate(keys, [seqs[k] for k in keys], sp)
    _check(backend.model, [seqs[k] for k in keys], outs)
    assert sess.covered[0][:4] == [5, 6, 7, 8]
    cache = sess.cache
    for rnd in range(3):  # extend, reorder, drop a row: the cache is reused and keeps matching a fresh pass
        for k, o in zip(keys, outs):
            seqs[k] = seqs[k] + o.token_ids
        keys = ["c", "a"] if rnd else ["a", "b", "c"]
        for i, k in enumerate(keys):
            seqs[k] = seqs[k] + [20 + rnd] * (i + 1)
        outs = sess.generate(keys, [seqs[k] for k in keys], sp)
        _check(backend.model, [seqs[k] for k in keys], outs)
    assert sess.cache is cache and sess.keys == ["c", "a"]
    assert any(after < before for before, after in widths)  # holes were compacted away


def test_a_prefix_tree_shares_prefill_exactly(backend):
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 50, 51, 52], [1, 2, 3, 4, 5, 6, 7, 8, 10],
               [1, 2, 3, 50, 51, 53, 54], [99]]
    (root,) = prefix_tree(prompts)  # [1, 2, 3] once, then [4..8] for rows 0 and 2, [50, 51] for rows 1 and 3
    assert (root.start, root.end, root.ends) == (0, 3, [])
    assert [(c.start, c.end, c.ends, c.children) for c in root.children] == [(3, 8, [0, 2], []), (3, 5, [1, 3], [])]
    sess = backend.session()
    sp = SamplingParams(temperature=1.0, max_new_tokens=5, seed=0)
    outs = sess.generate(list(range(5)), prompts, sp)
    _check(backend.model, prompts, outs)
    assert sess.covered[2][:8] == prompts[2][:8] and sess.covered[4][:1] == [99]


def test_prefix_tree_nests_every_shared_prefix_once():
    """System prompt -> entry task -> a GRPO group's rows up to the reward token -> same-token rows; a row that
    would be alone under a node ends at its parent; a row sharing nothing is not in the tree."""
    system, task_a, task_b = [1, 2, 3, 4], [10, 11, 12], [20, 21]
    high, low = [7, 30, 31], [8, 30, 31]
    prompts = [system + task_a + high + [40], system + task_a + high + [41], system + task_a + low + [42],
               system + task_b + high + [43], system + task_b + low + [44], system + [50], [60, 61]]

    def flat(nodes, depth=0):
        return [(depth, n.start, n.end, sorted(n.ends)) for n in nodes] + \
            [x for n in nodes for x in flat(n.children, depth + 1)]

    assert sorted(flat(prefix_tree(prompts))) == sorted([
        (0, 0, 4, [5]),  # system; row 5 has nothing past it (its last token is its own)
        (1, 4, 7, [2]), (2, 7, 10, [0, 1]),  # task a; row 2 alone under `low` ends at task a; rows 0, 1 share high
        (1, 4, 6, [3, 4]),  # task b: high and low rows each alone past it
    ])


def test_a_short_leaf_joins_the_rests_and_blocks_are_stored_once(backend):
    """`min_len`: a leaf adding fewer tokens than that to its parent is no node (a GRPO group's reward-token
    split); the session stores each block of rows once (CPU attention) and still matches full forwards."""
    system, task = list(range(100, 140)), list(range(200, 230))
    prompts = [system + task + [7, 9], system + task + [7, 9, 3], system + task + [8, 9], system + [50, 51]]
    flat = [(n.start, n.end, sorted(n.ends), len(n.children)) for n in walk(prefix_tree(prompts))]
    assert flat == [(0, 40, [3], 1), (40, 70, [2], 1), (70, 71, [0, 1], 0)]  # rows 0 and 1 share [7]
    assert [(n.start, n.end, sorted(n.ends)) for n in walk(prefix_tree(prompts, min_len=16))] == \
        [(0, 40, [3]), (40, 70, [0, 1, 2])]  # the 2-token leaf folded into the task
    sess = backend.session()
    outs = sess.generate([0, 1, 2, 3], prompts, SamplingParams(temperature=1.0, max_new_tokens=4, seed=1))
    _check(backend.model, prompts, outs)
    shared = sess.cache.shared
    assert backend.shared_prefixes and shared.width == 70 and shared.per_block == 3
    assert shared.slots.tolist() == [3, 4, 4, 2, 0, 1] and shared.of_row.tolist() == [4, 5, 3, 0]  # 4: no row
    assert sess.cache.n < 10  # the rows hold only what follows their block (<= 3 tokens) and what they decoded


def test_unrelated_prompts_and_stop_tokens(backend):
    prompts = [[100, 101, 102], [7, 8, 9, 10, 11, 12]]
    outs = backend.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=5))
    _check(backend.model, prompts, outs, 0.0)
    assert all(o.finish_reason in ("stop", "length") and len(o.token_ids) <= 5 for o in outs)
    assert backend.tokenizer.eos_token_id in backend.stop_ids


def test_top_p_keeps_only_the_nucleus():
    import torch

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).expand(200, -1)
    seeds, positions = torch.full((200,), 7), torch.arange(200)
    picks = sample_tokens(logits, SamplingParams(temperature=1.0, top_p=0.7), seeds, positions)[0].tolist()
    assert set(picks) == {0, 1} and 0.25 < picks.count(1) / 200 < 0.5  # nucleus {0.5, 0.3}: P(1) = 0.375
    tok, lp = sample_tokens(logits[:1], SamplingParams(temperature=0.0))
    assert int(tok) == 0 and float(lp) == pytest.approx(float(torch.log(torch.tensor(0.5))), abs=1e-6)


def test_adapter_folder_matches_in_memory_peft(tiny_model_dir, tmp_path):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                           LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    model.save_pretrained(tmp_path / "adapter")
    loaded = HFBackend(tiny_model_dir, tmp_path / "adapter")
    assert loaded.describe()["adapter"] == str(tmp_path / "adapter")
    prompt = [[5, 6, 7, 8, 9]]
    sp = SamplingParams(temperature=0.0, max_new_tokens=6)
    mem = HFBackend.from_model(model.eval().to(loaded.model.device), loaded.tokenizer).generate(prompt, sp)[0]
    disk = loaded.generate(prompt, sp)[0]
    assert disk.token_ids == mem.token_ids
    assert max(abs(a - b) for a, b in zip(disk.logprobs, mem.logprobs)) < 1e-4
    base = HFBackend(tiny_model_dir).generate(prompt, sp)[0]
    assert base.logprobs != disk.logprobs  # the adapter changed the model


def test_bf16_adapter_is_merged_in_fp32_like_a_saved_merged_policy(tiny_model_dir, tmp_path):
    """evaluate@rctp (adapter) and an RL output saved merged (fp32) must be the same bf16 weights."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                           LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    for name, prm in model.named_parameters():
        if "lora_B" in name:
            prm.data.normal_(0, 0.3)
    model.save_pretrained(tmp_path / "adapter")
    model.merge_and_unload().save_pretrained(tmp_path / "merged")
    HFBackend(tiny_model_dir).tokenizer.save_pretrained(tmp_path / "merged")
    via_adapter = HFBackend(tiny_model_dir, tmp_path / "adapter", dtype="bfloat16").model.state_dict()
    via_merged = HFBackend(tmp_path / "merged", dtype="bfloat16").model.state_dict()
    assert next(iter(via_adapter.values())).dtype == torch.bfloat16
    assert via_adapter.keys() == via_merged.keys()
    assert all(torch.equal(via_adapter[k], via_merged[k]) for k in via_adapter)


@pytest.mark.parametrize("case", ["missing", "no_config", "bad_json", "no_peft_type", "no_weights", "shape"])
def test_bad_model_or_adapter_raise_clear_errors(tiny_model_dir, tmp_path, case):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    cfg = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "task_type": "CAUSAL_LM"}
    if case == "missing":
        with pytest.raises(ModelLoadError, match="does not exist"):
            HFBackend(tmp_path / "nope")
        return
    if case == "no_config":
        (adapter / "x.txt").write_text("x")
    elif case == "bad_json":
        (adapter / "adapter_config.json").write_text("{")
    elif case == "no_peft_type":
        (adapter / "adapter_config.json").write_text(json.dumps({"r": 4}))
    elif case == "no_weights":
        (adapter / "adapter_config.json").write_text(json.dumps(cfg))
    else:  # weights of the wrong shape
        import torch
        from safetensors.torch import save_file

        (adapter / "adapter_config.json").write_text(json.dumps(cfg))
        save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 999)},
                  str(adapter / "adapter_model.safetensors"))
    with pytest.raises(ModelLoadError, match="adapter"):
        HFBackend(tiny_model_dir, adapter)


def test_scripted_backend_caps_and_stop(tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    b = ScriptedBackend(tok, {"k": ["[ls(a=True)]", "a much longer answer than the cap allows here"]})
    sess = b.session()
    first = sess.generate(["k"], [[1, 2]], SamplingParams(max_new_tokens=50))[0]
    assert first.finish_reason == "stop" and first.token_ids[-1] == tok.eos_token_id
    assert first.text == "[ls(a=True)]"
    second = sess.generate(["k"], [[1, 2]], SamplingParams(max_new_tokens=3))[0]
    assert second.finish_reason == "length" and len(second.token_ids) == 3
    assert sess.generate(["k"], [[1]], SamplingParams())[0].text == ""  # script exhausted -> ends


def test_vllm_is_import_guarded(tiny_model_dir):
    try:
        import vllm  # noqa: F401
    except ImportError:
        with pytest.raises(ModelLoadError, match=r"\[gpu\]"):
            load_backend("vllm", tiny_model_dir)
    with pytest.raises(ValueError, match="unknown backend"):
        load_backend("tpu", tiny_model_dir)


@pytest.mark.gpu
def test_vllm_backend_generates_with_logprobs(tiny_model_dir):
    torch = pytest.importorskip("torch")
    pytest.importorskip("vllm")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    b = VLLMBackend(tiny_model_dir, gpu_memory_utilization=0.3)
    outs = b.generate([[5, 6, 7], [5, 6, 8]], SamplingParams(temperature=1.0, max_new_tokens=5, seed=0))
    assert all(len(o.token_ids) == len(o.logprobs) > 0 for o in outs)


def test_autocast_option_runs_close_to_fp32(backend):
    fast = HFBackend.from_model(backend.model, backend.tokenizer, autocast=True)
    assert fast.autocast is True and HFBackend.from_model(backend.model, backend.tokenizer).autocast is False
    prompts = [[5, 6, 7, 8, 9, 10]]
    sp = SamplingParams(temperature=0.0, max_new_tokens=4)
    exact, approx = backend.generate(prompts, sp)[0], fast.generate(prompts, sp)[0]
    assert max(abs(a - b) for a, b in zip(exact.logprobs, approx.logprobs)) < 0.05


def test_exact_model_is_float32_and_the_same_weights(tiny_model_dir, backend):
    """A bf16 backend measures its margin on the same folder loaded in float32; a float32 one on itself."""
    import torch

    assert backend.exact_model() is backend.model
    half = HFBackend(tiny_model_dir, dtype="bfloat16", device="cpu")
    exact = half.exact_model()
    assert exact is not half.model and next(exact.parameters()).dtype == torch.float32
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        torch.testing.assert_close(exact(input_ids=ids).logits, backend.model(input_ids=ids).logits)
    live = HFBackend.from_model(half.model, half.tokenizer)
    with pytest.raises(ValueError, match="in-memory"):
        live.exact_model()
