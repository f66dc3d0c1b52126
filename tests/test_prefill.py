"""The CUDA path's prefill planning, run on the CPU: the prompts a session's rows share prefilled in a few
batched forwards per length bucket (plus one for every row's last token, plus one per decode step), not one
per prefix-tree node, with the same rollouts; the CPU itself keeps the prefix tree."""

from __future__ import annotations

from helpers import device_under_test
from test_backends import _check

from rcgrpo_tasks.engine.backend import SamplingParams
from rcgrpo_tasks.engine.hf import HFBackend, HFSession
from rcgrpo_tasks.engine.prefill import batched_prefill_wanted, left_padded, length_buckets, plan_prefill
from rcgrpo_tasks.engine.prefix_layout import prefix_tree, walk

SYSTEM = list(range(100, 140))
TASKS = [list(range(200, 217)), list(range(300, 320)), list(range(400, 430)), list(range(500, 540)),
         list(range(600, 660))]
"""Five tasks (each >= `HFSession.PREFIX_MIN`: a node of its own) on one system prompt: heads of 57 and 60
tokens (bucket 64), 70, 80 and 100 (bucket 128)."""


def _prompts(g: int = 3) -> list[list[int]]:
    """G rows per task, each ending with its own token (a GRPO group up to its reward token)."""
    return [SYSTEM + task + [7 + k] for task in TASKS for k in range(g)]


def test_plan_groups_rows_by_prompt_and_prompts_by_length_bucket():
    prompts = [[1, 2, 3], [1, 2, 4], [5], [1, 2, 3], [9] * 9, [8] * 17, [9] * 9, [8] * 17, [7] * 6]
    plan = plan_prefill(prompts, slices=8)
    # [7] * 6 shares its head with no row and [5] has none: `_prefill` appends their whole prompts
    assert plan.heads == [[1, 2], [1, 2], [], [1, 2], [9] * 8, [8] * 16, [9] * 8, [8] * 16, []]
    assert plan.distinct == [[1, 2], [9] * 8, [8] * 16] and plan.rows_of == [[0, 1, 3], [4, 6], [5, 7]]
    assert plan.batches == [[2], [1], [0]]  # 16 -> bucket 16, 8 -> bucket 8, 2 -> bucket 2: longest first
    assert plan_prefill(prompts, slices=1).batches == plan.batches
    assert length_buckets([3, 4, 5, 8, 9, 1]) == [[4], [2, 3], [0, 1], [5]]
    many = [[k] * (10 + k) + [1] for k in range(6) for _ in range(2)]  # 6 heads of 2 rows, one bucket
    assert [len(b) for b in plan_prefill(many, slices=4).batches] == [3, 3]  # <= ceil(12 / 4) heads a batch
    ids, mask = left_padded([[4, 5], [6]], pad_id=0)
    assert ids.tolist() == [[4, 5], [0, 6]] and mask.tolist() == [[True, True], [False, True]]


def test_batched_prefill_is_cudas_and_the_cpu_keeps_the_prefix_tree(backend):
    assert batched_prefill_wanted("cuda") and not batched_prefill_wanted("cpu")
    assert backend.batched_prefill is False  # CPU decoding: the prefix tree, as measured best there
    wrapped = HFBackend.from_model(backend.model, backend.tokenizer)
    assert wrapped.batched_prefill == (backend.model.device.type == "cuda")


def _forward_widths(monkeypatch, model) -> list[int]:
    """From now until the test ends, every forward of `model` appends its input width to the returned list."""
    widths, real = [], model.forward

    def forward(*args, **kwargs):
        ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        widths.append(ids.shape[1])
        return real(*args, **kwargs)

    monkeypatch.setitem(model.__dict__, "forward", forward)
    return widths


def test_forwards_per_session_on_the_cuda_path(backend, monkeypatch):
    prompts = _prompts()
    sampling = SamplingParams(temperature=1.0, max_new_tokens=4, seed=3)
    buckets = len(plan_prefill(prompts).batches)
    nodes = len(list(walk(prefix_tree(prompts, HFSession.PREFIX_MIN))))
    assert buckets < nodes == len(TASKS) + 1
    widths = _forward_widths(monkeypatch, backend.model)
    runs = {}
    for batched in (True, False):
        wrapped = HFBackend.from_model(backend.model, backend.tokenizer)
        wrapped.batched_prefill = batched  # forced: on the CPU, the path CUDA takes
        sess = wrapped.session()
        widths.clear()
        outs = sess.generate(list(range(len(prompts))), prompts, sampling)
        seen, steps = list(widths), max(len(o.token_ids) for o in outs)
        prefill = (buckets if batched else nodes) + 1  # + every row's last token(s) in one batched forward
        assert len(seen) == prefill + steps - 1, (batched, seen)
        assert seen[prefill:] == [1] * (steps - 1)  # then one forward per decode step
        _check(backend.model, prompts, outs)  # the log-probs of a full forward of each row
        runs[batched] = outs, sess
    assert [o.token_ids for o in runs[True][0]] == [o.token_ids for o in runs[False][0]]  # the same rollouts
    # A later call extends the batched session's rows (a new turn, KV reused): one forward, then decode.
    outs, sess = runs[True]
    turn = [p + o.token_ids + [30, 31] for p, o in zip(prompts, outs)]
    widths.clear()
    again = sess.generate(list(range(len(turn))), turn, sampling)
    assert len(widths) == max(len(o.token_ids) for o in again)
    _check(backend.model, turn, again)


def test_batched_prefill_on_the_device_under_test(tiny_model_dir, tok):
    """Wherever the suite runs (CUDA takes this path by itself): one-token prompts, repeated prompts, rows
    whose heads fall in different buckets, all against a full forward."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).to(device_under_test()).eval()
    b = HFBackend.from_model(model, tok)
    b.batched_prefill = True
    prompts = [[5], SYSTEM + [6], SYSTEM + TASKS[4] + [6], [5], SYSTEM + [7]]
    outs = b.session().generate(list(range(len(prompts))), prompts, SamplingParams(temperature=0.0, max_new_tokens=5))
    _check(model, prompts, outs, 0.0)
    assert torch.device(model.device).type == device_under_test().type
