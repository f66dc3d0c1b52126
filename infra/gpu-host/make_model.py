"""The GPU check's model: the configured architecture with random weights, and the real tokenizer.

Decode speed does not depend on the weights, so the check carries no weights: here `spec` writes the
configured model's config.json and tokenizer files (a few MB) from params.yaml's `prepare_model.source` (the
embedded SmolLM2 GGUF, or a local transformers folder); there `build` makes a seeded random-init model of
that config and saves it beside the tokenizer, a folder every stage and bench loads like prepare_model's.

    python infra/gpu-host/make_model.py spec --params params.yaml --out .gpucheck/model
    python infra/gpu-host/make_model.py build --spec .gpucheck/model --out /tmp/model --dtype bfloat16 [--tiny]

`--tiny`: the same vocabulary and tokenizer on a 2-layer, 64-wide network (the CPU dry run). A random-init
model never ends a turn by itself, so every row decodes to its `max_new_tokens`.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

TINY = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16}
"""The dry run's network (the test suite's tiny model): seconds on a CPU."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json")


def spec(params: Path, out: Path) -> None:
    """config.json and the tokenizer files of the model `prepare_model` would prepare, into `out`."""
    from transformers import AutoConfig, AutoTokenizer

    from rcgrpo_tasks.engine.source import PrepareModelConfig, embedded_gguf
    from rcgrpo_tasks.ops.config import load_config

    cfg = load_config(PrepareModelConfig, params, "prepare_model")
    out.mkdir(parents=True, exist_ok=True)
    if cfg.source == "embedded":
        gguf = embedded_gguf(cfg.gguf_file)
        AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
        return
    src = Path(cfg.source)
    if not (src / "config.json").is_file():
        raise SystemExit(f"prepare_model.source {cfg.source!r}: the check needs 'embedded' or a local model folder")
    for name in ("config.json", *TOKENIZER_FILES):
        if (src / name).is_file():
            shutil.copy(src / name, out / name)


def build(spec_dir: Path, out: Path, dtype: str, tiny: bool, seed: int = 0) -> int:
    """A random-init model of `spec_dir`'s config (TINY's sizes with `tiny`) in `dtype`, saved with the
    tokenizer (pad = EOS where it has none, as prepare_model writes it); returns its parameter count."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(spec_dir)
    if tiny:
        for key, value in TINY.items():
            setattr(config, key, value)
    tok = AutoTokenizer.from_pretrained(spec_dir)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("spec", help="here: config.json + tokenizer files of the configured model")
    s.add_argument("--params", type=Path, default=Path("params.yaml"))
    s.add_argument("--out", type=Path, required=True)
    b = sub.add_parser("build", help="there: a random-init model of a spec folder")
    b.add_argument("--spec", type=Path, required=True)
    b.add_argument("--out", type=Path, required=True)
    b.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    b.add_argument("--tiny", action="store_true", help="2 layers, 64 wide (the CPU dry run)")
    args = ap.parse_args()
    if args.cmd == "spec":
        spec(args.params, args.out)
        print(f"model spec in {args.out}: {sorted(p.name for p in args.out.iterdir())}")
    else:
        n = build(args.spec, args.out, args.dtype, args.tiny)
        print(f"random-init model in {args.out}: {n / 1e6:.1f}M parameters, {args.dtype}")


if __name__ == "__main__":
    main()
