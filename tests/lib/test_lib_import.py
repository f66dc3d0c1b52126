"""The public API imports and builds with the pipeline's MLOps stack absent: Prefect, MLflow, DVC, Great
Expectations and boto3 are hidden from a child interpreter (a view of site-packages without them, `-S`: no
site hooks), as on a machine that installed the package without its `pipeline` extra."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HIDDEN = ("mlflow", "prefect", "dvc", "great_expectations", "boto3")
"""Top-level modules (and distributions: `great_expectations` is `great-expectations`) the library must not need."""

CHILD = r"""
import importlib.util, json, sys
hidden = json.loads(sys.argv[1])
assert all(importlib.util.find_spec(m) is None for m in hidden), "the view still holds a hidden package"
import rcgrpo
from rcgrpo import *  # noqa: F403
from rcgrpo import RCGRPOConfig, RCGRPOTrainer
import rcgrpo.goal, rcgrpo.draw, rcgrpo.group_metrics, rcgrpo.rctp, rcgrpo.controllability, rcgrpo.tokens
cfg = RCGRPOConfig("/tmp/rcgrpo-import-test", report_to=[], use_cpu=True, bf16=False)
for extra in sys.argv[2:]:
    __import__(extra)
print(json.dumps({"loaded": sorted({m.split(".")[0] for m in sys.modules} & set(hidden)), "beta": cfg.beta,
                  "subclass": issubclass(RCGRPOTrainer, __import__("trl").GRPOTrainer)
                  and issubclass(RCGRPOConfig, __import__("trl").GRPOConfig)}))
"""


def _hidden(name: str) -> bool:
    stem = name.split("-")[0].split(".")[0].lower().replace("_", "")
    return any(stem == h.replace("_", "") or stem.startswith(h.replace("_", "") + "_") for h in HIDDEN) \
        or name.lower().startswith(("dvc_", "dvc-"))


def site_view(tmp_path: Path) -> Path:
    """A folder of links to every site-packages entry except the hidden packages and their metadata."""
    site = Path(sysconfig.get_paths()["purelib"])
    view = tmp_path / "site"
    view.mkdir()
    for entry in site.iterdir():
        if entry.suffix == ".pth" or _hidden(entry.name):
            continue
        (view / entry.name).symlink_to(entry)
    return view


def run_child(tmp_path: Path, *extra: str) -> dict:
    view = site_view(tmp_path)
    code = f"import sys; sys.path[1:1] = [{str(REPO)!r}, {str(view)!r}]\n" + CHILD
    out = subprocess.run([sys.executable, "-S", "-c", code, json.dumps(HIDDEN), *extra], capture_output=True,
                         text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_public_api_needs_no_mlops_package(tmp_path):
    got = run_child(tmp_path)
    assert got == {"loaded": [], "beta": 0.1, "subclass": True}


@pytest.mark.parametrize("name", HIDDEN)
def test_the_view_hides_each_package(tmp_path, name):
    """The check can fail: in the view, importing a hidden package fails as if it were not installed."""
    view = site_view(tmp_path)
    code = f"import sys; sys.path[1:1] = [{str(view)!r}]\nimport {name}"
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "No module named" in out.stderr


@pytest.mark.skipif(importlib.util.find_spec("bfcl_eval") is None, reason="bfcl-eval is not installed")
def test_bfcl_for_trl_users_needs_no_mlops_package(tmp_path):
    """BFCL's datasets, reward and environments for TRL (`rcgrpo_tasks.integrations`) load without them too."""
    got = run_child(tmp_path, "rcgrpo_tasks.integrations", "rcgrpo_tasks.integrations.bfcl_single_turn",
                    "rcgrpo_tasks.integrations.bfcl_multi_turn")
    assert got["loaded"] == []
