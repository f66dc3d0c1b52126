"""The pipeline trainer (`train.rl.pipeline_trainer.PipelineTrainer`) resumed from a checkpoint inside a generation
batch trains what the uninterrupted run trains, bit for bit, on TRL's own generation: TRL's batch in flight travels
with the checkpoint (`train.common.generation_state`) and each epoch's order is seeded."""

from __future__ import annotations

import copy
import os

import pytest
from helpers import LEVELS

torch = pytest.importorskip("torch")

from rcgrpo_tasks.train.common.generation_state import GENERATION_STATE  # noqa: E402

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
WALL_CLOCK = ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second")


class Cut(Exception):
    """The simulated kill."""


def _reward(completions, completion_ids, **_):
    """Depends on the completion only."""
    return [float(len(ids) % 3 == 0) + 0.1 * (ids[0] % 2 if ids else 0) for ids in completion_ids]


def _trainer(model, tok, out, callbacks=()):
    from datasets import Dataset
    from transformers import set_seed

    from rcgrpo import RCGRPOConfig, reward_token_lora_config
    from rcgrpo_tasks.train.rl.pipeline_trainer import Options, pipeline_trainer

    # 2 optimizer steps per generation batch of 2 groups: checkpoint 1 falls inside the first one
    args = RCGRPOConfig(str(out), max_steps=3, num_generations=2, per_device_train_batch_size=2,
                        steps_per_generation=2, max_completion_length=5, report_to=[], use_cpu=True, bf16=False,
                        logging_steps=1, save_strategy="steps", save_steps=1, disable_tqdm=True, seed=3,
                        learning_rate=1e-2, reward_tokens=list(LEVELS))
    lora = reward_token_lora_config(model, tok, LEVELS, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": f"Add {i} and 4."}]} for i in range(6)])
    set_seed(0)
    return pipeline_trainer()(model=model, reward_funcs=_reward, args=args, train_dataset=ds, processing_class=tok,
                           peft_config=lora, callbacks=list(callbacks), options=Options(kl_token_max=10.0))


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


def test_a_run_cut_inside_a_generation_batch_resumes_exactly(rl_env, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, model_dir = rl_env
    model, tok = AutoModelForCausalLM.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir)
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
    assert any(not torch.equal(a[k], p) for k, p in _trained(_trainer(copy.deepcopy(model), tok, tmp_path / "x")).items())
    assert _logs(full) == _logs(resumed)
    assert [e["step"] for e in _logs(resumed) if "reward" in e] == [1, 3]  # two generations, none redone
    assert full.last_generation == resumed.last_generation and full.last_generation.mode == "train"
