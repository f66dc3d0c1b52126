"""`RCGRPOTrainer` resumed from a checkpoint inside a generation batch trains what the uninterrupted run trains,
bit for bit, on TRL's own generation (`rcgrpo.resume`)."""

from __future__ import annotations

import copy
import os

import pytest

torch = pytest.importorskip("torch")
trl = pytest.importorskip("trl")

from rcgrpo import RCGRPOConfig, RCGRPOTrainer, reward_token_lora_config  # noqa: E402
from rcgrpo.resume import GENERATION_STATE  # noqa: E402

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
WALL_CLOCK = ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second")


class Cut(Exception):
    """The simulated kill."""


def _trainer(model, tok, out, callbacks=()):
    from test_lib_trainer import dataset, length_reward, make_args
    from transformers import set_seed

    # 2 optimizer steps per generation batch of 2 groups: checkpoint 1 falls inside the first one
    args = RCGRPOConfig(str(out), **make_args(out, max_steps=3, per_device_train_batch_size=4, steps_per_generation=2,
                                              save_strategy="steps", save_steps=1))
    lora = reward_token_lora_config(model, tok, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    set_seed(0)
    return RCGRPOTrainer(model=model, reward_funcs=length_reward, args=args, train_dataset=dataset(),
                         processing_class=tok, peft_config=lora, callbacks=list(callbacks))


def _cut_at_step_2():
    from transformers import TrainerCallback

    class CutAt2(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if state.global_step == 2 and "loss" in (logs or {}):
                raise Cut

    return CutAt2()


def _trained(trainer) -> dict:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


def _logs(trainer) -> list[dict]:
    """The step logs (the closing one's `train_loss` covers the `train()` call: after the resume only)."""
    return [{k: v for k, v in e.items() if k not in WALL_CLOCK} for e in trainer.state.log_history if "loss" in e]


def test_a_run_cut_inside_a_generation_batch_resumes_exactly(lib_model, tmp_path):
    model, tok = lib_model
    full = _trainer(copy.deepcopy(model), tok, tmp_path / "full")
    full.train()
    with pytest.raises(Cut):
        _trainer(copy.deepcopy(model), tok, tmp_path / "cut", [_cut_at_step_2()]).train()
    checkpoint = tmp_path / "cut" / "checkpoint-1"
    assert (checkpoint / f"{GENERATION_STATE}.pt").is_file()
    resumed = _trainer(copy.deepcopy(model), tok, tmp_path / "cut")
    resumed.train(resume_from_checkpoint=str(checkpoint))

    a, b = _trained(full), _trained(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert _logs(full) == _logs(resumed)
    assert [e["step"] for e in _logs(resumed) if "reward" in e] == [1, 3]  # two generations, none redone
