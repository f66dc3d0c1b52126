"""THE dtype rule: what every stage decodes in and whether it trains under bf16 autocast, from one setting.

params `compute.cpu_bf16` (`engine.compute`; a params dependency of every stage that decodes or trains, so
DVC reruns them when it changes) decides the CPU:
- `off` (the committed default): float32 everywhere on a CPU. Every host computes the same numbers, so a run
  reproduces the committed outputs, and the budgets hold on the slowest host (AVX2 only: no native bf16);
- `on`: bf16 for decoding (`dtype: auto`, RL's rollout snapshot) and bf16 autocast for training (`bf16:
  null`) on a CPU;
- `auto`: what this host measured, once (`calibrate`: a decode step and a forward + backward at the stages'
  own shapes, float32 beside bf16), cached per CPU model, flags, torch version, threads and model shape
  (`cache_file`); bf16 only where it measured at least `AUTO_MIN_SPEEDUP` faster, decoding and training
  apart. Two CPUs with the same flags measured opposite ways (bf16 faster on one, slower on the other:
  docs/log.md, "CPU bf16"), hence a measurement and not a flag; `bench/cpu_bf16.py` runs the same
  calibration at a model's full depth.
On CUDA `auto` / `null` mean bf16 where the GPU has it, whatever `cpu_bf16` says. A dtype a stage names
explicitly (`dtype: float32`, `bf16: true`) is never overridden. Each stage applies these rules once
(`engine.compute.resolve_compute`: a `ResolvedCompute`, passed down and recorded whole in its metrics); the
layers below take its values and refuse an unresolved `auto` / `null`.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import os
import platform
import statistics
import time
from pathlib import Path

from rcgrpo_tasks.ops.inputs import InputError

CPU_BF16 = ("off", "on", "auto")
CALIBRATION_VERSION = 1
AUTO_MIN_SPEEDUP = 1.1
"""`auto` takes bf16 on a CPU only where the calibration measured it at least this much faster: a measured 1.0x
is a tie within the timing's noise, and bf16 gives up float32's exact numbers for nothing there."""


def check_setting(setting: str) -> str:
    if setting not in CPU_BF16:
        raise ValueError(f"cpu_bf16 must be one of {CPU_BF16} (quoted in YAML: a bare off / on reads as a "
                         f"boolean), got {setting!r}")
    return setting


def decode_rule(requested: str, device_type: str, setting: str, model_dir: str | Path | None = None) -> tuple[str, str]:
    """(float32 | bfloat16, where the choice came from) of a stage's decoding `dtype`: an explicit dtype as it
    is; `auto` bf16 on a CUDA GPU with bf16, on a CPU as `setting` says."""
    if requested != "auto":
        return requested, "explicit"
    if device_type == "cuda":
        import torch

        return ("bfloat16" if torch.cuda.is_bf16_supported() else "float32"), "gpu"
    got = cpu_bf16(setting, model_dir)
    return ("bfloat16" if got["decode"] else "float32"), got["source"]


def train_rule(flag: bool | None, device_type: str, setting: str, model_dir: str | Path | None = None) -> tuple[bool, str]:
    """(bf16 autocast of a training run, where the choice came from): `flag`, or (None) on a CUDA GPU with
    bf16, on a CPU as `setting` says."""
    if flag is not None:
        return flag, "explicit"
    if device_type == "cuda":
        import torch

        return torch.cuda.is_bf16_supported(), "gpu"
    got = cpu_bf16(setting, model_dir)
    return got["train"], got["source"]


def cpu_bf16(setting: str, model_dir: str | Path | None = None) -> dict:
    """{"decode": bool, "train": bool, "source": "params off" | "params on" | "measured auto", "measured": the
    calibration (None unless `auto`)} of a CPU under `setting`; `auto` takes bf16 where the calibration at the
    shape of `model_dir`'s config (SmolLM2-135M's where none is given), measured once per host, found it at
    least `AUTO_MIN_SPEEDUP` faster: decoding and training apart."""
    check_setting(setting)
    if setting != "auto":
        return {"decode": setting == "on", "train": setting == "on", "source": f"params {setting}", "measured": None}
    got = measured(model_shape(model_dir))
    return {"decode": got["decode_speedup"] >= AUTO_MIN_SPEEDUP, "train": got["train_speedup"] >= AUTO_MIN_SPEEDUP,
            "source": "measured auto", "measured": {**got, "min_speedup": AUTO_MIN_SPEEDUP}}


# -- auto: measured once on this host -----------------------------------------------------------------------

SMOLLM2_135M = (576, 1536, 9, 3, 64)
"""(hidden, intermediate, heads, kv heads, head_dim) of the embedded default."""


def model_shape(model_dir: str | Path | None) -> tuple[int, int, int, int, int]:
    cfg_file = Path(model_dir) / "config.json" if model_dir else None
    if cfg_file is None or not cfg_file.is_file():
        return SMOLLM2_135M
    c = json.loads(cfg_file.read_text())
    heads = c["num_attention_heads"]
    return (c["hidden_size"], c["intermediate_size"], heads, c.get("num_key_value_heads") or heads,
            c.get("head_dim") or c["hidden_size"] // heads)


def host_key(shape: tuple, threads: int) -> str:
    """What a measurement depends on: CPU model and flags, torch version, threads, the model's shape."""
    import torch

    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else platform.processor()
    lines = info.splitlines()
    name = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), platform.machine())
    flags = next((ln for ln in lines if ln.startswith("flags")), "")
    digest = hashlib.sha1(f"{flags}|{torch.__version__}|{threads}|{shape}|{CALIBRATION_VERSION}".encode())
    return f"{name} | {digest.hexdigest()[:16]}"


def cache_file() -> Path:
    """$RCGRPO_CACHE_DIR (else $XDG_CACHE_HOME/rcgrpo, else ~/.cache/rcgrpo) / cpu_bf16.json."""
    root = os.environ.get("RCGRPO_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rcgrpo"
    return Path(root) / "cpu_bf16.json"


def measured(shape: tuple) -> dict:
    """The calibration (`calibrate`) of this host at `shape`: read from the cache (`cache_file`, keyed by
    `host_key`), measured and written there the first time; with the cache file's path."""
    return copy.deepcopy(_measured(shape))


@functools.cache
def _measured(shape: tuple) -> dict:
    import torch

    key = host_key(shape, torch.get_num_threads())
    path = cache_file()
    try:
        known = json.loads(path.read_text()) if path.is_file() else {}
    except ValueError as exc:
        raise InputError(f"{path}: not JSON ({exc}); delete it to measure again") from exc
    if key not in known:
        known[key] = calibrate(shape)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(known, indent=1, sort_keys=True))
        tmp.replace(path)
    return {**known[key], "cache": str(path)}


def calibrate(shape: tuple, layers: int = 4, rows: int = 16, tokens: int = 320, reps: int = 5) -> dict:
    """bf16 against float32 on this CPU, arms alternating, medians: one decode step of `rows` rows against a
    `tokens` cache (what evaluate, sample_policy and RL's rollouts spend their time in) and a forward +
    backward of 4 x 256 tokens (an SFT or RL micro-batch), on a random `layers`-layer model of `shape` (a
    layer's matmuls are the stages' own; their count only scales both arms). Speed-ups > 1: bf16 is faster."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, inter, heads, kv, head_dim = shape
    cfg = LlamaConfig(vocab_size=49152, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim, tie_word_embeddings=True)
    gen = torch.Generator().manual_seed(0)
    with torch.random.fork_rng():  # the stage's own random state is left as it was
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg)
    half = copy.deepcopy(model).to(torch.bfloat16)
    ids = torch.randint(0, cfg.vocab_size, (rows, tokens), generator=gen)

    def decode(net):
        net.eval()
        with torch.no_grad():
            cache = net(input_ids=ids, use_cache=True).past_key_values

        def run():
            with torch.no_grad():
                net(input_ids=ids[:, -1:], past_key_values=cache, use_cache=True)
                cache.crop(-1)
        return run

    batch = ids[:4, :256]

    def train(autocast: bool):
        def run():
            model.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
        return run

    t0 = time.perf_counter()
    dec = side_by_side(decode(model), decode(half), reps * 2)
    model.train()
    trn = side_by_side(train(False), train(True), reps)
    return {"decode_speedup": dec, "train_speedup": trn, "seconds": round(time.perf_counter() - t0, 1),
            "threads": torch.get_num_threads(), "shape": list(shape), "torch": torch.__version__}


def side_by_side(fp32, bf16, reps: int) -> float:
    """median(float32 seconds) / median(bf16 seconds), the arms alternating after one warm-up each."""
    fp32(), bf16()
    times: dict[int, list[float]] = {0: [], 1: []}
    for r in range(reps):
        for k in ((0, 1) if r % 2 == 0 else (1, 0)):
            t = time.perf_counter()
            (fp32, bf16)[k]()
            times[k].append(time.perf_counter() - t)
    return statistics.median(times[0]) / statistics.median(times[1])
