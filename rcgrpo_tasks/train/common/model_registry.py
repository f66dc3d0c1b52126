"""A PEFT adapter as an MLflow model (`mlflow.transformers`) referencing its local base folder, and back."""

from __future__ import annotations

from pathlib import Path

from rcgrpo_tasks.engine.models import load_trained
from rcgrpo_tasks.ops.tracking_store import TrackingError
from rcgrpo_tasks.train.common.adapters import small_adapter_saves


def log_model(model, tokenizer, model_dir: Path) -> None:
    """The PEFT model as an `mlflow.transformers` model referencing the LOCAL base folder (loads offline).

    Load it back with `load_logged_model(uri)`: the base needs its embeddings grown to the adapter's
    tokenizer first, which mlflow's own loader does not do (its `peft/` folder is a `load_trained` folder).
    """
    import importlib.metadata as md

    import mlflow

    # Explicit requirements: mlflow's inference would pin torchvision, which this CPU stack does not have.
    reqs = [f"{p}=={md.version(p)}" for p in ("torch", "transformers", "peft", "accelerate")]
    try:
        with small_adapter_saves(model, tokenizer):
            mlflow.transformers.log_model(
                transformers_model={"model": model, "tokenizer": tokenizer}, name="model", task="text-generation",
                base_model_path=str(Path(model_dir).resolve()), pip_requirements=reqs)
    except Exception as exc:
        raise TrackingError(f"MLflow log_model (transformers, PEFT) failed: {exc}") from exc


def load_logged_model(model_uri: str, dtype: str = "float32"):
    """(model, tokenizer) from an MLflow model logged by `log_model` (e.g. `runs:/<id>/model`)."""
    import mlflow
    import yaml

    local = Path(mlflow.artifacts.download_artifacts(model_uri))
    flavor = yaml.safe_load((local / "MLmodel").read_text())["flavors"]["transformers"]
    base = flavor.get("model_local_base") or flavor.get("source_model_name")
    return load_trained(base, local / flavor.get("peft_adaptor", "peft"), dtype=dtype)
