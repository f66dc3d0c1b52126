"""Stage `rl`: GRPO / RC-GRPO on TRL's `GRPOTrainer`, rolling out multi-turn BFCL episodes.

What it does (one run of the grid init x algo, e.g. `rl@rctp-rc_grpo`):
1. Loads the init model: base + the SFT/RCTP adapter (`sft.load_trained`), MERGED into the base weights
   (`merge_and_unload`), then hands TRL a fresh LoRA (`peft_config`). TRL computes the reference
   log-probs with the adapter disabled, which is therefore exactly the init (SFT/RCTP) model: the KL
   term anchors to the RCTP model, as in the paper, not to the raw base.
2. Trains with `GRPOTrainer(rollout_func=...)`: the dataset rows are train-split entry ids; the rollout
   function runs the project's rollout engine (`engine.run_group`) on the current policy
   (`HFBackend.from_model` over a merged bf16 copy refreshed every generation on CPU, see
   `policy_snapshot`; TRL's vLLM engine on GPU): the environment executes the model's calls
   between model steps; per rollout TRL gets prompt ids (system + first user message, with the rollout's
   own reward token), completion ids (everything after, model and environment tokens), `env_mask`
   (environment tokens carry no loss) and the sampling log-probs.
3. Rewards come from the shared scorer, computed by the engine: `paper` (binary trajectory reward,
   default), `official` (BFCL per-turn verdict) or `partial` (partial credit) drives the advantage; all
   three are always logged (TRL reward functions with one-hot `reward_weights`).
4. Conditioning (`--conditioning`, default from the grid: `advantages.conditioning_for(init, algo)`):
   `rc` = each rollout draws its token i.i.d. (P(high)=p), advantage over the whole group (TRL's own
   group normalisation is exactly RC-GRPO's; see `advantages.py`); `fixed` = every rollout
   `<|high_reward|>`; `none` = no token.
5. Diagnostics every step -> MLflow (`tracking`) and `--plots` TSV (`dvc plots`): reward overall and per
   token, controllability gap, fraction of zero-std groups (tolerance 1e-6), mean |A|, KL, clip fraction,
   completion / call / step counts, environment errors, rollout tokens/s, step time.
6. Checkpoints every `save_steps` into `--checkpoints` (a DVC `persist` output); a re-run with the same
   params and inputs resumes from the last one (a fingerprint file guards against resuming with other
   params, in which case the stale checkpoints are discarded).

Writes: `--out` (merged policy: HF model folder + tokenizer + `rl_adapter/` + `rcgrpo_model.json`,
atomically), `--metrics` (summary JSON), `--plots` (per-step TSV).
Run: `rcgrpo rl --init rctp --algo rc_grpo --model-dir models/base --adapter-dir models/sft/rctp
--entries data/entries.jsonl --split data/split.json --out models/rl/rctp-rc_grpo ...`.

Departures from the paper (documented in docs/rl.md): tiny budgets on CPU (the paper: Qwen2.5-7B, G=5,
batch 256, 400 steps -> `configs/paper.yaml`); LoRA on the merged init instead of full fine-tuning.

Why a subclass (`RCGRPOTrainer`): TRL does not expose the advantages it used, nor a public way for a
rollout function to add per-step metrics; the subclass only wraps `_generate_and_score_completions` to
read the advantages (mean |A|, cross-checked against `advantages.group_advantages` in the tests) and
adds `record_metric`. Training, loss, KL and clipping are TRL's.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import typer

from rcgrpo_tasks import advantages as adv
from rcgrpo_tasks.config import ConfigError, as_dict, load_config
from rcgrpo_tasks.io import atomic_dir, write_json

REWARD_NAMES = {"paper": "paper_reward", "official": "official_verdict", "partial": "partial_credit"}
FINGERPRINT_FILE = "rcgrpo_rl_fingerprint.json"
PLOT_COLUMNS = (
    "step", "reward", "reward_high", "reward_low", "reward_none", "controllability_gap", "frac_zero_std",
    "adv_abs_mean", "kl", "clip_ratio", "loss", "reward_paper", "reward_official", "reward_partial",
    "model_tokens", "n_calls", "n_steps", "env_errors", "rollout_tokens_per_s", "rollout_s", "step_time",
)


@dataclass(frozen=True)
class RLConfig:
    num_generations: int = 4
    """G: rollouts per entry (group size). Paper: 5."""
    batch_size: int = 4
    """Rollouts per optimizer step (= entries per step x G); must be a multiple of G. Paper: 256 prompts."""
    micro_batch_size: int = 4
    """Rollouts per forward/backward on one device; batch_size must be a multiple (grad accumulation)."""
    max_steps: int = 2
    """Optimizer steps. Paper: 400."""
    learning_rate: float = 1e-5
    """LoRA learning rate (paper, full fine-tuning: 1e-6)."""
    lr_scheduler: str = "constant"
    """transformers scheduler name."""
    beta: float = 0.1
    """KL coefficient to the init (SFT/RCTP) model. Paper: 0.1."""
    epsilon: float = 0.2
    """PPO clip range. Paper: 0.2."""
    num_iterations: int = 1
    """PPO epochs per generation batch (mu); with 1 the ratio is 1 and nothing is clipped."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """TRL advantage scaling: `group` = GRPO's (r - mean) / std over the group."""
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = "grpo"
    """TRL loss aggregation; `grpo` = per-sequence token mean, then batch mean (the GRPO paper's)."""
    p_high: float = 0.5
    """RC-GRPO: P(<|high_reward|>) of each rollout's i.i.d. token. Paper: 0.5."""
    reward: Literal["paper", "official", "partial"] = "paper"
    """Reward that drives the advantage; the other two are logged."""
    temperature: float = 1.0
    """Sampling temperature of rollouts (TRL rescales its log-probs with the same value)."""
    top_p: float = 1.0
    """Nucleus sampling of rollouts."""
    max_new_tokens: int = 32
    """Tokens per model output (one model step of an episode)."""
    protocol: Literal["paper", "official"] = "paper"
    """Rollout protocol: `paper` (merged steps + done()) or `official` (BFCL turn by turn)."""
    doc_style: Literal["compact", "json", "official"] = "compact"
    """Function docs in the prompt: `compact`, `json` or `official`."""
    system_prompt: Literal["bfcl", "short"] = "bfcl"
    """`bfcl` (BFCL's classic instructions) or `short`."""
    max_episode_steps: int = 2
    """Model outputs per episode (`paper`: ProtocolConfig.max_steps; `official`: per turn)."""
    categories: tuple[str, ...] = ("base", "miss_func", "miss_param", "long_context")
    """Train-split categories to sample entries from."""
    max_entries: int | None = None
    """Use only this many train entries (the shortest prompts first); null = all."""
    full_finetune: bool = False
    """Train every weight (the paper; GPU + DeepSpeed) instead of a LoRA on top of the merged init."""
    lora_r: int = 8
    """Rank of the RL LoRA (on top of the merged init)."""
    lora_alpha: int = 16
    """LoRA alpha."""
    lora_dropout: float = 0.0
    """LoRA dropout (0: rollouts and training see the same policy)."""
    lora_target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    """Modules the RL LoRA adapts."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype the merged init weights are held in (LoRA weights stay float32)."""
    rollout_dtype: Literal["auto", "live", "float32", "bfloat16"] = "auto"
    """Rollouts (without vLLM) sample from a merged copy of the policy in this dtype, refreshed every
    generation; `live` = from the training model itself; `auto` = bfloat16 on a bf16-capable CPU, else live."""
    bf16: bool | None = None
    """bf16 autocast for the trainer's forward/backward; None = where supported (GPU, CPU with AVX512-BF16/AMX)."""
    gradient_checkpointing: bool = False
    """Trade compute for memory (on for 7B on GPU)."""
    save_steps: int = 1
    """Checkpoint every N optimizer steps (resume point)."""
    save_total_limit: int = 2
    """Checkpoints kept."""
    use_vllm: bool = False
    """GPU: rollouts on TRL's vLLM engine (`vllm_mode`)."""
    vllm_mode: Literal["colocate", "server"] = "colocate"
    """`colocate` (vLLM inside the trainer processes) or `server` (`trl vllm-serve`)."""
    vllm_gpu_memory_utilization: float = 0.3
    """colocate: GPU memory fraction for vLLM."""
    deepspeed: str | None = None
    """DeepSpeed JSON (GPU; e.g. configs/ds_zero3.json under `accelerate launch`)."""
    seed: int = 0
    """Seed of LoRA init, entry order, reward tokens and sampling."""
    extra: dict = field(default_factory=dict)
    """Extra GRPOConfig keyword arguments (escape hatch, e.g. deepspeed config path, bf16)."""

    def __post_init__(self) -> None:
        g = self.num_generations
        if g < 2:
            raise ValueError(f"num_generations (G) must be >= 2 for a group advantage, got {g}")
        if not 0.0 < self.p_high < 1.0:
            raise ValueError(f"p_high must be in (0, 1) (exclusive), got {self.p_high}")
        if self.batch_size < g or self.batch_size % g:
            raise ValueError(f"batch_size ({self.batch_size}) must be a positive multiple of num_generations ({g})")
        if self.micro_batch_size < 1 or self.batch_size % self.micro_batch_size:
            raise ValueError(f"batch_size ({self.batch_size}) must be a multiple of micro_batch_size "
                             f"({self.micro_batch_size})")
        for name in ("max_steps", "save_steps", "num_iterations", "max_new_tokens", "max_episode_steps", "lora_r"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.learning_rate <= 0 or self.beta < 0 or not 0 < self.epsilon < 1:
            raise ValueError("need learning_rate > 0, beta >= 0 and 0 < epsilon < 1")
        if not 0 < self.temperature or not 0 < self.top_p <= 1:
            raise ValueError("need temperature > 0 and 0 < top_p <= 1")
        if self.max_entries is not None and self.max_entries * g < self.batch_size:
            raise ValueError(f"max_entries ({self.max_entries}) x G < batch_size: a step needs "
                             f"{self.batch_size // g} distinct entries")

    @property
    def entries_per_step(self) -> int:
        return self.batch_size // self.num_generations


def check_world(cfg: RLConfig, world_size: int) -> int:
    """Gradient-accumulation steps for `world_size` processes; groups must not straddle processes."""
    per_proc = cfg.batch_size // world_size if cfg.batch_size % world_size == 0 else 0
    if not per_proc or per_proc % cfg.num_generations or per_proc % cfg.micro_batch_size:
        raise ConfigError(f"rl: batch_size {cfg.batch_size} must split into {world_size} process(es) of whole "
                          f"groups (G={cfg.num_generations}) and micro-batches ({cfg.micro_batch_size})")
    return per_proc // cfg.micro_batch_size


# ---------------------------------------------------------------- data and models


def train_entries(entries_path: Path, split_path: Path, cfg: RLConfig, tokenizer=None) -> list:
    """Train-split entries of `cfg.categories` (optionally the `max_entries` with the shortest prompts)."""
    from rcgrpo_tasks.bfcl import Entry
    from rcgrpo_tasks.io import read_jsonl
    from rcgrpo_tasks.prepare_data import load_split

    train_ids = set(load_split(split_path)["train"])
    rows = [Entry.from_json(r) for r in read_jsonl(entries_path)]
    entries = [e for e in rows if e.id in train_ids and e.category in cfg.categories]
    if cfg.max_entries is not None:
        entries.sort(key=lambda e: (_prompt_tokens(e, cfg, tokenizer), e.id))
        entries = entries[: cfg.max_entries]
    if len(entries) < cfg.entries_per_step:
        raise ConfigError(f"{split_path}: {len(entries)} train entries in {cfg.categories}, need at least "
                          f"{cfg.entries_per_step} per step")
    return entries


def _prompt_tokens(entry, cfg: RLConfig, tokenizer) -> int:
    from rcgrpo_tasks.protocols import initial_messages

    text = "".join(m["content"] for m in initial_messages(entry, protocol_config(cfg)))
    return len(tokenizer(text)["input_ids"]) if tokenizer is not None else len(text)


def protocol_config(cfg: RLConfig):
    from rcgrpo_tasks.protocols import ProtocolConfig

    steps = {"max_steps": cfg.max_episode_steps} if cfg.protocol == "paper" else {
        "max_steps_per_turn": cfg.max_episode_steps}
    return ProtocolConfig(protocol=cfg.protocol, doc_style=cfg.doc_style, system_prompt=cfg.system_prompt, **steps)


def load_init_model(model_dir: Path, adapter_dir: Path | None, dtype: str):
    """(model, tokenizer) of the init policy, its adapter MERGED into the weights: the KL reference.

    `sft.load_trained` restores the SFT/RCTP adapter, its tokenizer and the reward-token rows; merging
    makes the init a plain model, so the RL LoRA that TRL adds sits on top of it and "adapter disabled"
    (TRL's reference) is the init model itself.
    """
    import torch

    from rcgrpo_tasks import sft

    model, tokenizer = sft.load_trained(model_dir, adapter_dir, dtype=dtype)
    if hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
    return model.to(getattr(torch, dtype)), tokenizer


def check_reward_tokens(tokenizer, mode: str) -> None:
    """`rc`/`fixed` need both reward tokens as single vocabulary items (added by SFT/RCTP)."""
    if mode == "none":
        return
    for tok in adv.REWARD_TOKENS:
        ids = tokenizer.convert_tokens_to_ids(tok)
        single = len(tokenizer(tok, add_special_tokens=False)["input_ids"]) == 1
        if ids is None or ids == tokenizer.unk_token_id or not single:
            raise ConfigError(f"conditioning {mode!r} needs {tok} as a special token of the init model's tokenizer "
                              "(train the init with `sft` / RCTP, which adds it)")


def fingerprint(cfg: RLConfig, **inputs: Any) -> str:
    """Hash of params + run arguments + input file contents: a checkpoint resumes only under the same one."""
    h = hashlib.sha256(json.dumps(as_dict(cfg), sort_keys=True, default=str).encode())
    for key in sorted(inputs):
        value = inputs[key]
        h.update(f"{key}={value}".encode())
        path = Path(str(value)) if value is not None else None
        if path is not None and path.is_file():
            h.update(hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()


def last_checkpoint(ckpt_dir: Path, fp: str) -> str | None:
    """The newest `checkpoint-N` under `ckpt_dir` if its fingerprint matches; stale ones are removed."""
    from transformers.trainer_utils import get_last_checkpoint

    if not ckpt_dir.is_dir():
        return None
    fp_file = ckpt_dir / FINGERPRINT_FILE
    if not fp_file.is_file() or json.loads(fp_file.read_text()).get("fingerprint") != fp:
        shutil.rmtree(ckpt_dir)  # other params or inputs: these checkpoints belong to another run
        return None
    return get_last_checkpoint(str(ckpt_dir))


# ---------------------------------------------------------------- trainer, rollouts, diagnostics


def _trainer_class():
    from trl import GRPOTrainer

    class RCGRPOTrainer(GRPOTrainer):
        """GRPOTrainer + per-step metrics from the rollout function + the advantages it used (read-only)."""

        last_advantages: list[float] = []

        def record_metric(self, name: str, value: float) -> None:
            mode = "train" if self.model.training else "eval"
            self._metrics[mode][name].append(float(value))

        def _generate_and_score_completions(self, inputs):
            output = super()._generate_and_score_completions(inputs)
            a = output["advantages"].detach().float().cpu().tolist()
            self.last_advantages = a
            self.record_metric("rc/adv_abs_mean", adv.advantage_spread(a))
            return output

        def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep,
                                               batch_size=None, compute_entropy=False, compute_aux_loss=False,
                                               **multimodal):
            # CPU fast path. Without Triton, TRL 1.16's fused LM head scores EVERY position (static tile
            # shapes for Neuron), i.e. ~1k prompt positions per ~50 completion tokens through a 49k vocabulary;
            # on CPU that dominated the step (~10x). Here only the completion positions are projected
            # (`logits_to_keep`), with the same temperature scaling. GPU and multimodal inputs: TRL's path.
            if input_ids.device.type != "cpu" or compute_aux_loss or any(v is not None for v in multimodal.values()):
                return super()._get_per_token_logps_and_entropies(
                    model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss,
                    **multimodal)
            with self.accelerator.autocast():
                return _completion_logps(model, input_ids, attention_mask, logits_to_keep, self.temperature,
                                         batch_size or input_ids.size(0), compute_entropy)

    return RCGRPOTrainer


def _completion_logps(model, input_ids, attention_mask, logits_to_keep: int, temperature: float, batch_size: int,
                      compute_entropy: bool):
    """input_ids (B, P+C) -> (log-probs (B, C), entropies (B, C) or None, None) of the last C tokens."""
    import torch

    logps, ents = [], []
    for s in range(0, input_ids.size(0), batch_size):
        ids = input_ids[s : s + batch_size]
        out = model(input_ids=ids, attention_mask=attention_mask[s : s + batch_size], use_cache=False,
                    logits_to_keep=logits_to_keep + 1)
        logits = out.logits[:, :-1, :].float() / temperature  # (b, C, V): position t predicts token t+1
        logp_all = torch.log_softmax(logits, dim=-1)
        logps.append(logp_all.gather(-1, ids[:, -logits_to_keep:].unsqueeze(-1)).squeeze(-1))
        if compute_entropy:
            with torch.no_grad():
                ents.append(-(logp_all.exp() * logp_all).sum(-1))
    return torch.cat(logps), (torch.cat(ents) if compute_entropy else None), None


def _reward_funcs():
    """One TRL reward function per score; `reward_weights` select the one that drives the advantage."""

    def paper_reward(completions, r_paper, **_):
        return [None if r is None else float(r) for r in r_paper]

    def official_verdict(completions, r_official, **_):
        return [None if r is None else float(r) for r in r_official]

    def partial_credit(completions, r_partial, **_):
        return [None if r is None else float(r) for r in r_partial]

    return [paper_reward, official_verdict, partial_credit]


def trl_vllm_backend(trainer, tokenizer):
    """GPU path (not run on CPU): the rollout engine's vLLM backend over the vLLM engine TRL manages.

    TRL pushes the policy's weights into its vLLM before each `rollout_func` call (`sync_weights`), so the
    engine samples from the current policy. `colocate`: TRL's in-process `vllm.LLM` is wrapped in the
    engine's `VLLMBackend` (prefix caching, token-id prompts, sampled log-probs). `server` (`trl vllm-serve`):
    only the main process holds TRL's weight-sync client; every process sends its own completions to the
    server's OpenAI-compatible endpoint through a plain `VLLMClient` (no communicator).
    """
    from rcgrpo_tasks.backends import Completion, Session, VLLMBackend, _decode

    gen = trainer.vllm_generation
    if gen.mode == "colocate":
        backend = VLLMBackend.__new__(VLLMBackend)
        backend.llm, backend.tokenizer, backend.lora = gen.llm, tokenizer, None
        backend.max_positions = gen.llm.llm_engine.model_config.max_model_len
        backend.info = {"backend": "vllm", "model": "<trl colocate>", "adapter": None}
        return backend

    from trl.generation.vllm_client import VLLMClient

    client = VLLMClient(base_url=trainer.args.vllm_server_base_url
                        or f"http://{trainer.args.vllm_server_host}:{trainer.args.vllm_server_port}")

    class _ServerSession(Session):
        def generate(self, keys, prompts, sampling, max_new_tokens=None):
            caps = max_new_tokens or [sampling.max_new_tokens] * len(prompts)
            out = []
            for prompt, cap in zip(prompts, caps):  # per-row caps; the server batches concurrent requests
                r = client.generate([list(prompt)], n=1, temperature=sampling.temperature, top_p=sampling.top_p,
                                    max_tokens=cap, logprobs=0)
                ids, lps = r["completion_ids"][0], [lp[0] for lp in r["logprobs"][0]]
                stops = backend.stop_ids
                finish = "stop" if ids and ids[-1] in stops else "length"
                out.append(Completion(ids, lps, _decode(tokenizer, ids, stops), finish))
            return out

    backend = VLLMBackend.__new__(VLLMBackend)
    backend.tokenizer, backend.max_positions = tokenizer, trainer.args.vllm_max_model_length or 8192
    backend.info = {"backend": "vllm", "model": "<trl server>", "adapter": None}
    backend.session = lambda: _ServerSession()
    return backend


def _n_calls(result) -> int:
    return sum(len(step) for turn in result for step in turn)


def _env_errors(messages) -> int:
    return sum(m.get("role") == "tool" and str(m.get("content", "")).startswith("Error during execution")
               for m in messages)


def rollout_dtype(setting: str, device_type: str):
    """torch dtype of the rollout snapshot, or None to sample from the live training model."""
    import torch

    from rcgrpo_tasks.backends import bf16_supported

    if setting == "auto":
        return torch.bfloat16 if device_type == "cpu" and bf16_supported() else None
    return None if setting == "live" else getattr(torch, setting)


def policy_snapshot(model, dtype, snapshot=None):
    """The current policy as a plain model in `dtype`: base weights + LoRA deltas merged (or all weights).

    Why: CPU decoding is memory-bound; sampling from the PEFT model reads the fp32 base and runs every LoRA
    matmul per token (bench/rl_snapshot.py, idle 2-core box: the snapshot's rollout phase is 2.0x faster,
    with the engine's CPU decode attention on the copy; docs/rl.md). The copy is allocated once and
    refreshed in place before each rollout phase (only LoRA layers change; `get_delta_weight` leaves the
    frozen base, i.e. the KL reference, untouched). Same policy up to bf16 rounding, as vLLM on GPU.
    """
    import torch
    from peft.tuners.lora import LoraLayer
    from transformers import AutoModelForCausalLM

    from rcgrpo_tasks.hf_session import use_cpu_attention

    peft = hasattr(model, "get_base_model")
    base = model.get_base_model() if peft else model
    fresh = snapshot is None
    if fresh:
        snapshot = AutoModelForCausalLM.from_config(copy.deepcopy(base.config), dtype=dtype).eval().requires_grad_(False)
        use_cpu_attention(snapshot)  # a sampling-only copy: the engine's faster CPU decode attention
    with torch.no_grad():
        for name, param in snapshot.named_parameters():
            module_name, _, leaf = name.rpartition(".")
            module = base.get_submodule(module_name)
            if isinstance(module, LoraLayer) and leaf == "weight":
                adapter = module.active_adapters[0]
                param.copy_(module.base_layer.weight + module.get_delta_weight(adapter))
            elif fresh or not peft:  # frozen under LoRA: copied once
                param.copy_(base.get_parameter(name) if not isinstance(module, LoraLayer)
                            else getattr(module.base_layer, leaf))
    return snapshot


class EngineRollout:
    """TRL `rollout_func`: one engine group per run of identical entry ids in the (per-process) batch."""

    def __init__(self, cfg: RLConfig, mode: adv.Conditioning, entries: dict, tokenizer):
        self.cfg, self.mode, self.entries, self.tokenizer = cfg, mode, entries, tokenizer
        self.last: list = []  # trajectories of the latest call (tests, debugging)
        self.snapshot = None  # CPU: merged low-precision copy of the policy that the engine samples from

    def _backend(self, trainer):
        from rcgrpo_tasks.backends import HFBackend

        if trainer.use_vllm:
            return trl_vllm_backend(trainer, self.tokenizer)
        model = trainer.accelerator.unwrap_model(trainer.model)
        dtype = rollout_dtype(self.cfg.rollout_dtype, next(model.parameters()).device.type)
        if dtype is not None:
            self.snapshot = policy_snapshot(model, dtype, self.snapshot)
            model = self.snapshot
        return HFBackend.from_model(model, self.tokenizer)

    def __call__(self, prompts: list, trainer) -> dict:
        from rcgrpo_tasks import engine
        from rcgrpo_tasks.backends import SamplingParams

        step, proc = trainer.state.global_step, trainer.accelerator.process_index
        tokens = adv.sample_reward_tokens(len(prompts), self.mode, self.cfg.p_high,
                                          adv.token_seed(self.cfg.seed, step, proc))
        sampling = SamplingParams(temperature=self.cfg.temperature, top_p=self.cfg.top_p,
                                  max_new_tokens=self.cfg.max_new_tokens,
                                  seed=adv.token_seed(self.cfg.seed, step, proc, call=1))
        model = trainer.model
        was_training = model.training
        model.eval()  # no dropout when sampling from the live model; TRL reads its mode before and after
        t0 = time.perf_counter()
        try:
            backend = self._backend(trainer)
            trajs = []
            for start in range(0, len(prompts), g := self.cfg.num_generations):
                group = prompts[start : start + g]
                if len(group) != g or len(set(group)) != 1:  # TRL lays out whole groups; check, never guess
                    raise RuntimeError(f"rollout batch is not whole groups of G={g}: {prompts}")
                trajs += engine.run_group(backend, self.entries[group[0]], n=g, protocol_cfg=protocol_config(self.cfg),
                                          sampling=sampling, reward_tokens=tokens[start : start + g])
        finally:
            model.train(was_training)
        elapsed = time.perf_counter() - t0
        self.last = trajs
        self._record(trainer, trajs, elapsed)
        return self._to_trl(trajs)

    def _to_trl(self, trajs) -> dict:
        out: dict[str, list] = {k: [] for k in ("prompt_ids", "completion_ids", "logprobs", "env_mask", "r_paper",
                                                "r_official", "r_partial", "reward_token", "entry_id")}
        eos = self.tokenizer.eos_token_id
        for t in trajs:
            p, c, m, lp = adv.trajectory_fields(t.token_ids, t.prompt_len, t.completion_mask, t.logprobs)
            if not c:  # nothing generated (e.g. context limit at once): one masked token keeps TRL's shapes
                c, m, lp = [eos], [0], [0.0]
            s = t.score
            out["prompt_ids"].append(p)
            out["completion_ids"].append(c)
            out["env_mask"].append(m)
            out["logprobs"].append(lp)
            out["r_paper"].append(None if s is None else float(s["paper_reward"]))
            out["r_official"].append(None if s is None else float(bool(s["valid"])))
            out["r_partial"].append(None if s is None else float(s["partial_credit"]))
            out["reward_token"].append(t.reward_token)
            out["entry_id"].append(t.entry_id)
        return out

    def _record(self, trainer, trajs, elapsed: float) -> None:
        key = {"paper": "paper_reward", "official": "valid", "partial": "partial_credit"}[self.cfg.reward]
        rewards = [float(t.score[key]) if t.score else float("nan") for t in trajs]
        tokens = [t.reward_token for t in trajs]
        by = adv.reward_by_token(rewards, tokens)
        n_tok = sum(t.n_model_tokens for t in trajs)
        metrics = {
            "rc/reward": sum(rewards) / len(rewards),
            "rc/reward_high": by.get("high", float("nan")),
            "rc/reward_low": by.get("low", float("nan")),
            "rc/reward_none": by.get("none", float("nan")),
            "rc/controllability_gap": adv.controllability_gap(rewards, tokens),
            "rc/frac_zero_std": adv.zero_std_fraction(rewards, self.cfg.num_generations),
            "rc/model_tokens": n_tok / len(trajs),
            "rc/n_calls": sum(_n_calls(t.result) for t in trajs) / len(trajs),
            "rc/n_steps": sum(t.n_steps for t in trajs) / len(trajs),
            "rc/env_errors": sum(_env_errors(t.messages) for t in trajs) / len(trajs),
            "rc/frac_terminated_error": sum(t.termination == "error" for t in trajs) / len(trajs),
            "rc/rollout_tokens_per_s": n_tok / elapsed if elapsed > 0 else float("nan"),
            "rc/rollout_s": elapsed,
        }
        for name, value in metrics.items():
            trainer.record_metric(name, value)


def _row(logs: dict, step: int) -> dict:
    """TRL's averaged step logs -> one row of the plots TSV (PLOT_COLUMNS)."""
    src = {
        "reward": "rc/reward", "reward_high": "rc/reward_high", "reward_low": "rc/reward_low",
        "reward_none": "rc/reward_none", "controllability_gap": "rc/controllability_gap",
        "frac_zero_std": "rc/frac_zero_std", "adv_abs_mean": "rc/adv_abs_mean", "kl": "kl",
        "clip_ratio": "clip_ratio/region_mean", "loss": "loss", "reward_paper": "rewards/paper_reward/mean",
        "reward_official": "rewards/official_verdict/mean", "reward_partial": "rewards/partial_credit/mean",
        "model_tokens": "rc/model_tokens", "n_calls": "rc/n_calls", "n_steps": "rc/n_steps",
        "env_errors": "rc/env_errors", "rollout_tokens_per_s": "rc/rollout_tokens_per_s",
        "rollout_s": "rc/rollout_s", "step_time": "step_time",
    }
    row: dict = {"step": step}
    for col, key in src.items():
        value = logs.get(key)
        row[col] = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else float("nan")
    return row


def read_tsv(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    lines = path.read_text().splitlines()
    header = lines[0].split("\t") if lines else []
    return [{k: (float(v) if v else float("nan")) for k, v in zip(header, ln.split("\t"))} for ln in lines[1:] if ln]


def write_tsv(path: Path, rows: list[dict]) -> None:
    from rcgrpo_tasks.io import write_text

    def fmt(v):
        return "" if isinstance(v, float) and math.isnan(v) else (str(int(v)) if float(v).is_integer() else f"{v:.6g}")

    body = ["\t".join(PLOT_COLUMNS)] + ["\t".join(fmt(r.get(c, float("nan"))) for c in PLOT_COLUMNS) for r in rows]
    write_text(path, "\n".join(body) + "\n")


def _diagnostics_callback(tsv: Path, log_to_mlflow: bool):
    from transformers import TrainerCallback

    class DiagnosticsLogger(TrainerCallback):
        """Every step's TRL + rollout metrics -> MLflow (with the step) and the resumable TSV."""

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not state.is_world_process_zero or not logs or "rc/reward" not in logs:
                return
            numeric = {k: v for k, v in logs.items()
                       if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
            row = _row(logs, state.global_step)
            if log_to_mlflow:
                from rcgrpo_tasks import tracking

                tracking.log_metrics({**numeric, **_diag_metrics(row)}, step=state.global_step)
            write_tsv(tsv, [r for r in read_tsv(tsv) if r["step"] < state.global_step] + [row])

    return DiagnosticsLogger()


def _hash_dir(path: Path | None) -> str:
    """Content fingerprint of a model/adapter folder (large files: name, size, first and last MiB)."""
    if path is None or not Path(path).exists():
        return "none"
    h = hashlib.sha256()
    for f in sorted(p for p in Path(path).rglob("*") if p.is_file()):
        h.update(f"{f.relative_to(path)}:{f.stat().st_size}".encode())
        with f.open("rb") as fh:
            h.update(fh.read(1 << 20))
            if f.stat().st_size > 2 << 20:
                fh.seek(-(1 << 20), os.SEEK_END)
                h.update(fh.read())
    return h.hexdigest()


def summarize(rows: list[dict]) -> dict:
    """Per-run summary of the step rows: mean over steps (NaN-free) of each diagnostic, and the last reward."""
    out: dict = {"steps": len(rows)}
    for col in PLOT_COLUMNS[1:]:
        vals = [r[col] for r in rows if col in r and not math.isnan(r[col])]
        out[f"mean_{col}"] = sum(vals) / len(vals) if vals else None
    out["last_reward"] = rows[-1]["reward"] if rows and not math.isnan(rows[-1]["reward"]) else None
    return out


def resolve_bf16(flag: bool | None) -> bool:
    import torch

    from rcgrpo_tasks.backends import bf16_supported

    if flag is not None:
        return flag
    return torch.cuda.is_bf16_supported() if torch.cuda.is_available() else bf16_supported()


def grpo_args(cfg: RLConfig, ckpt_dir: Path, grad_accum: int):
    import torch
    from trl import GRPOConfig

    weights = [1.0 if name == REWARD_NAMES[cfg.reward] else 0.0 for name in REWARD_NAMES.values()]
    kwargs = dict(
        output_dir=str(ckpt_dir), per_device_train_batch_size=cfg.micro_batch_size,
        gradient_accumulation_steps=grad_accum, num_generations=cfg.num_generations, max_steps=cfg.max_steps,
        learning_rate=cfg.learning_rate, lr_scheduler_type=cfg.lr_scheduler, warmup_steps=0, beta=cfg.beta,
        epsilon=cfg.epsilon, num_iterations=cfg.num_iterations, scale_rewards=cfg.scale_rewards,
        loss_type=cfg.loss_type, reward_weights=weights, temperature=cfg.temperature, top_p=cfg.top_p,
        max_completion_length=cfg.max_new_tokens * cfg.max_episode_steps, disable_dropout=True,
        gradient_checkpointing=cfg.gradient_checkpointing, logging_steps=1, save_strategy="steps",
        save_steps=cfg.save_steps, save_total_limit=cfg.save_total_limit, report_to=[], seed=cfg.seed,
        data_seed=cfg.seed, remove_unused_columns=False, dataloader_num_workers=0, disable_tqdm=True,
        bf16=resolve_bf16(cfg.bf16), use_cpu=not torch.cuda.is_available(), deepspeed=cfg.deepspeed,
        use_vllm=cfg.use_vllm,
        vllm_mode=cfg.vllm_mode, vllm_gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
    )
    kwargs.update(cfg.extra)
    return GRPOConfig(**kwargs)


@dataclass(frozen=True)
class RunSpec:
    """One grid cell and its paths (CLI arguments, not params: the DVC matrix varies them)."""

    init: str
    algo: str
    model_dir: Path
    adapter_dir: Path | None
    entries: Path
    split: Path
    out: Path
    checkpoints: Path
    metrics: Path | None = None
    plots: Path | None = None
    conditioning: str | None = None

    @property
    def mode(self) -> adv.Conditioning:
        mode = self.conditioning or adv.conditioning_for(self.init, self.algo)
        if mode not in adv.CONDITIONING_MODES:
            raise ConfigError(f"conditioning must be one of {adv.CONDITIONING_MODES}, got {mode!r}")
        return mode

    @property
    def name(self) -> str:
        return f"{self.init}-{self.algo}"


def build_trainer(cfg: RLConfig, spec: RunSpec, callbacks: list | None = None, log_to_mlflow: bool = True):
    """(trainer, checkpoint to resume or None, rollout function) -- everything checked before training."""
    from datasets import Dataset
    from peft import LoraConfig

    mode = spec.mode
    grad_accum = check_world(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    model, tokenizer = load_init_model(spec.model_dir, spec.adapter_dir, cfg.dtype)
    check_reward_tokens(tokenizer, mode)
    entries = train_entries(spec.entries, spec.split, cfg, tokenizer)
    fp = fingerprint(cfg, init=spec.init, algo=spec.algo, mode=mode, entries=spec.entries, split=spec.split,
                     model=_hash_dir(spec.model_dir), adapter=_hash_dir(spec.adapter_dir))
    resume = last_checkpoint(spec.checkpoints, fp)
    spec.checkpoints.mkdir(parents=True, exist_ok=True)
    write_json(spec.checkpoints / FINGERPRINT_FILE, {"fingerprint": fp, "run": spec.name})
    rollout = EngineRollout(cfg, mode, {e.id: e for e in entries}, tokenizer)
    lora = None
    if cfg.full_finetune:
        # No PEFT: TRL builds its reference model from `config._name_or_path`, so that path must BE the init.
        model = _init_on_disk(model, tokenizer, spec, cfg.dtype)
    else:
        lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                          target_modules=list(cfg.lora_target_modules), task_type="CAUSAL_LM")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is "experimental" in TRL 1.16
    trainer = _trainer_class()(
        model=model, reward_funcs=_reward_funcs(), args=grpo_args(cfg, spec.checkpoints, grad_accum),
        train_dataset=Dataset.from_list([{"prompt": e.id} for e in entries]), processing_class=tokenizer,
        peft_config=lora, rollout_func=rollout,
        callbacks=[_diagnostics_callback(spec.checkpoints / "diagnostics.tsv", log_to_mlflow), *(callbacks or [])],
    )
    if lora is not None:
        # The RL LoRA sits on the MERGED init; pointing it at the base folder would make PEFT see the resized
        # vocabulary and store the whole embedding matrix in every checkpoint (~110 MB each, untrained).
        peft_model = trainer.accelerator.unwrap_model(trainer.model)
        peft_model.peft_config["default"].base_model_name_or_path = None
        peft_model.get_base_model().name_or_path = ""  # PEFT refills the field from here on every save
    return trainer, resume, rollout


def _init_on_disk(model, tokenizer, spec: RunSpec, dtype: str):
    """Full fine-tuning: the merged init saved under the checkpoints folder and reloaded from there."""
    import torch
    from transformers import AutoModelForCausalLM

    src = Path(model.config._name_or_path or "")
    if spec.adapter_dir is None or src.resolve() == Path(spec.adapter_dir).resolve():
        return model  # the base, or a full fine-tune folder: its own path is the init already
    init_dir = spec.checkpoints / "init_merged"
    if not (init_dir / "config.json").is_file():
        with atomic_dir(init_dir) as tmp:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
    return AutoModelForCausalLM.from_pretrained(init_dir, dtype=getattr(torch, dtype))


def save_policy(trainer, cfg: RLConfig, spec: RunSpec, provenance: dict) -> None:
    """Atomically write the policy to `spec.out`: init + RL LoRA merged (+ `rl_adapter/`), or the full model.

    Every process must call it: under DeepSpeed ZeRO-3 `save_model` gathers the sharded weights.
    """
    final = spec.checkpoints / "final"
    if cfg.full_finetune:
        trainer.save_model(str(final))
    if not trainer.accelerator.is_main_process:
        return
    with atomic_dir(spec.out) as tmp:
        if cfg.full_finetune:
            for f in final.iterdir():
                shutil.move(str(f), tmp / f.name)
        else:
            model = trainer.accelerator.unwrap_model(trainer.model)
            model.save_pretrained(tmp / "rl_adapter")
            model.merge_and_unload().save_pretrained(tmp)
        trainer.processing_class.save_pretrained(tmp)
        write_json(tmp / "rcgrpo_model.json", provenance)


def train_rl(cfg: RLConfig, spec: RunSpec, callbacks: list | None = None) -> dict:
    """Run (or resume) one RL run; returns the summary written to `spec.metrics` (main process)."""
    import contextlib

    from rcgrpo_tasks import tracking

    mode = spec.mode
    main_proc = int(os.environ.get("RANK", "0")) == 0  # under `accelerate launch`, one MLflow run (rank 0)
    tags = {"rl.init": spec.init, "rl.algo": spec.algo, "rl.conditioning": mode}
    run = tracking.stage_run(f"rl@{spec.name}", {"rl": as_dict(cfg), "run": {**tags, "adapter": str(spec.adapter_dir)}},
                             tags=tags) if main_proc else contextlib.nullcontext()
    with run:
        trainer, resume, _ = build_trainer(cfg, spec, callbacks, log_to_mlflow=main_proc)
        tsv = spec.checkpoints / "diagnostics.tsv"
        if resume and main_proc:  # replay the steps done before the interruption into this run
            for r in read_tsv(tsv):
                tracking.log_metrics(_diag_metrics(r), step=int(r["step"]))
        t0 = time.perf_counter()
        result = trainer.train(resume_from_checkpoint=resume)
        save_policy(trainer, cfg, spec, {
            "stage": "rl", "init": spec.init, "algo": spec.algo, "conditioning": mode,
            "base_model": str(spec.model_dir), "init_adapter": str(spec.adapter_dir) if spec.adapter_dir else None,
            "steps": trainer.state.global_step, "config": as_dict(cfg)})
        if not main_proc:
            return {}
        rows = [r for r in read_tsv(tsv) if r["step"] <= trainer.state.global_step]
        summary = {**summarize(rows), "init": spec.init, "algo": spec.algo, "conditioning": mode,
                   "resumed_from": resume, "train_s": time.perf_counter() - t0,
                   "train_loss": result.training_loss}
        if spec.plots:
            write_tsv(spec.plots, rows)
        if spec.metrics:
            write_json(spec.metrics, summary)
        tracking.log_metrics({f"summary/{k}": v for k, v in summary.items()
                              if isinstance(v, (int, float)) and not isinstance(v, bool)})
        for path in (spec.plots, spec.metrics, spec.out / "rcgrpo_model.json"):
            if path and Path(path).is_file():
                tracking.log_artifact(path)
    return summary


def _diag_metrics(row: dict) -> dict:
    """A TSV row as MLflow metrics `diag/<column>` (the same names live and when replayed after a resume)."""
    return {f"diag/{k}": v for k, v in row.items() if k != "step" and not math.isnan(v)}


app = typer.Typer(add_completion=False, help=__doc__.split("\n\n")[0])


@app.command()
def main(
    init: str = typer.Option(..., help="Init model kind: sft | rctp (names the grid cell; picks the conditioning)."),
    algo: str = typer.Option(..., help="grpo | rc_grpo."),
    model_dir: Path = typer.Option(Path("models/base"), help="Base model folder (prepare_model)."),
    adapter_dir: Path = typer.Option(None, help="Init adapter (sft stage); omit to start from the base."),
    entries: Path = typer.Option(Path("data/entries.jsonl"), help="Entries JSONL (prepare_data)."),
    split: Path = typer.Option(Path("data/split.json"), help="Split JSON (prepare_data); train side is used."),
    out: Path = typer.Option(..., help="Output: merged policy folder (replaced atomically)."),
    checkpoints: Path = typer.Option(..., help="Checkpoint folder (kept across runs: resume point)."),
    metrics: Path = typer.Option(None, help="Output: summary metrics JSON."),
    plots: Path = typer.Option(None, help="Output: per-step diagnostics TSV."),
    conditioning: str = typer.Option(None, help="Override: rc | fixed | none (default: from init x algo)."),
    params: Path = typer.Option(Path("params.yaml"), help="Params file (section `rl`)."),
) -> None:
    """GRPO / RC-GRPO on TRL GRPOTrainer over the multi-turn rollout engine."""
    try:
        cfg = load_config(RLConfig, params, "rl")
        spec = RunSpec(init=init, algo=algo, model_dir=model_dir, adapter_dir=adapter_dir, entries=entries,
                       split=split, out=out, checkpoints=checkpoints, metrics=metrics, plots=plots,
                       conditioning=conditioning)
        spec.mode  # validate before any heavy import
    except (ConfigError, ValueError) as exc:
        typer.echo(f"rl: {exc}", err=True)
        raise typer.Exit(2) from exc
    summary = train_rl(cfg, spec)
    typer.echo(json.dumps({k: summary.get(k) for k in ("steps", "mean_reward", "mean_frac_zero_std",
                                                          "mean_controllability_gap", "resumed_from")}))


if __name__ == "__main__":
    app()
