"""The policy RL rollouts sample from, and whether it differs from the policy TRL trains.

- `rollout_dtype` / `policy_snapshot`: a merged copy of the policy (bf16 or float32) on its own device,
  refreshed before every generation (CPU decoding is memory-bound, and the PEFT model runs every LoRA
  matmul per token); `rollout_dtype: live` samples from the training model itself.
- `trl_vllm_backend`: the engine's vLLM backend over the vLLM engine TRL manages (GPU).
- `sampler_differs`: whether the sampler's numerics differ from the trainer's (vLLM, a snapshot copy, bf16
  autocast in the trainer only): where `rl.importance_sampling: auto` turns the correction on.
"""

from __future__ import annotations

import copy

from rcgrpo_tasks.engine.compute import check_resolved
from rcgrpo_tasks.engine.cpu_attention import use_cpu_attention
from rcgrpo_tasks.engine.vllm import VLLMBackend, VLLMServerBackend


def rollout_dtype(setting: str):
    """torch dtype of the rollout snapshot, or None to sample from the live training model, for a run's resolved
    `rollout_dtype` (`RLConfig.resolved`: on a CPU a merged copy in THE dtype rule's dtype, float32 by default:
    the same numbers as the trainer up to merge rounding, at about twice the live PEFT model's decode speed,
    docs/log.md, "Engine"; on a GPU the live model). `auto` is refused: the run resolves it."""
    import torch

    setting = check_resolved(setting, "rl.rollout_dtype")
    return None if setting == "live" else getattr(torch, setting)


def sampler_differs(use_vllm: bool, snapshot_dtype, trainer_autocast: bool) -> bool:
    """True unless the rollouts come from the training model itself with the trainer's numerics: vLLM, a
    snapshot copy (merged weights, in any dtype), or bf16 autocast in the trainer only (the engine samples
    the live model without autocast)."""
    return use_vllm or snapshot_dtype is not None or trainer_autocast


def policy_snapshot(model, dtype, snapshot=None):
    """The current policy as a plain model in `dtype`: base weights + LoRA deltas merged (or all weights).

    Why: CPU decoding is memory-bound; sampling from the PEFT model reads the fp32 base and runs every LoRA
    matmul per token (bench/rl_snapshot.py compares the two; docs/rl.md has the measurement). The copy is
    allocated once, on the policy's own device (CPU or GPU: a CPU copy of a GPU policy would decode on
    the CPU), and refreshed in place before each rollout phase: LoRA layers (`get_delta_weight` leaves the
    frozen base, i.e. the KL reference, untouched) and the trainable reward-token rows (PEFT's wrapper
    serves its matrix with the trained rows merged); on the CPU it decodes with the engine's CPU attention.
    Same policy up to the rounding of `dtype`, as vLLM on GPU.
    """
    import torch
    from peft.tuners.lora import LoraLayer
    from transformers import AutoModelForCausalLM

    peft = hasattr(model, "get_base_model")
    base = model.get_base_model() if peft else model
    fresh = snapshot is None
    if fresh:
        device = next(base.parameters()).device
        # Its random init is overwritten below; drawn from the global generators it would shift the training's
        # random stream (TRL's batch shuffle), and a resumed run builds the copy at another step than the
        # uninterrupted one.
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.device(device):
            snapshot = AutoModelForCausalLM.from_config(copy.deepcopy(base.config), dtype=dtype)
        snapshot.eval().requires_grad_(False)
        use_cpu_attention(snapshot)  # CPU only: a sampling-only copy gets the engine's faster decode attention
    with torch.no_grad():
        for name, param in snapshot.named_parameters():
            module_name, _, leaf = name.rpartition(".")
            module = base.get_submodule(module_name)
            if isinstance(module, LoraLayer) and leaf == "weight":
                adapter = module.active_adapters[0]
                param.copy_(module.base_layer.weight + module.get_delta_weight(adapter))
            elif hasattr(module, "token_adapter") and leaf == "weight":  # trainable token rows: they change
                param.copy_(module.weight)
            elif fresh or not peft:  # frozen under LoRA: copied once
                param.copy_(base.get_parameter(name) if not isinstance(module, LoraLayer)
                            else getattr(module.base_layer, leaf))
    return snapshot


def trl_vllm_backend(trainer, tokenizer):
    """The rollout engine's vLLM backend over the vLLM engine TRL manages (`rl.use_vllm`; `colocate` runs on
    vLLM's CPU build too, `server` needs NCCL for TRL's weight sync: GPU only).

    TRL pushes the policy's weights into its vLLM before each `rollout_func` call (`sync_weights`), so the
    engine samples from the current policy. `colocate`: TRL's in-process `vllm.LLM` (prefix caching,
    token-id prompts, sampled log-probs). `server` (`trl vllm-serve`): only the main process holds TRL's
    weight-sync client; every process sends its own completions to the server through a plain `VLLMClient`
    (no communicator).
    """
    gen = trainer.vllm_generation
    if gen.mode == "colocate":
        return VLLMBackend.from_llm(gen.llm, tokenizer, model="<trl colocate>")
    from trl.generation.vllm_client import VLLMClient

    args = trainer.args
    client = VLLMClient(base_url=args.vllm_server_base_url or f"http://{args.vllm_server_host}:{args.vllm_server_port}")
    return VLLMServerBackend(client, tokenizer, max_positions=args.vllm_max_model_length or 8192,
                             model="<trl server>")
