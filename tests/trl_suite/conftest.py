"""The hub-free harness that runs TRL's own GRPO tests (trl_upstream/, copied unmodified: README.md) against
plain TRL (`baseline`) or `rcgrpo.RCGRPOTrainer` (`none`, `rc`).

Off unless `TRL_SUITE_MODE` is set (`make test-trl-suite` sets it): then `make test`, which collects tests/,
neither collects the vendored module nor changes the environment. With a mode set:
- before anything imports huggingface_hub, `HF_HUB_CACHE` points at a tiny hub (`tiny_hub.build_hub`: built
  once per directory `TRL_SUITE_HUB`, default a fresh temporary one) and the hub is offline (`HF_HUB_OFFLINE`,
  `HF_DATASETS_OFFLINE`): every model id resolves there and nothing reaches the network;
- the test module's `load_dataset` (and `datasets.load_dataset`) is `tiny_hub.load_dataset`;
- in `none` / `rc` the module's `GRPOTrainer` / `GRPOConfig` are `modes.mode_classes(mode)`; the vendored file
  itself is never edited, so a refresh is a copy;
- availability probes the vendored helpers import from `trl.import_utils` and the installed TRL lacks
  (`is_<package>_available`) are added there, each `find_spec(<package>)` (`add_missing_probes`);
- tests the harness cannot serve are skipped with the reason (`SKIPS`); the file's own markers skip the rest
  (vLLM, liger, an accelerator, ...).
The upstream conftest.py beside the tests (CPU forcing, cleanup) applies as it does in TRL's CI.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

MODE_ENV, HUB_ENV = "TRL_SUITE_MODE", "TRL_SUITE_HUB"
UPSTREAM = "trl_upstream"
TEST_MODULE = "test_grpo_trainer"
HERE = Path(__file__).parent
MODE = os.environ.get(MODE_ENV, "")
MODES = ("baseline", "none", "rc")  # modes.MODES (that module imports TRL: not before the environment is set)

SKIPS = {
    "TestGRPOTrainerVLM": "vision-language: the harness builds no VLM models, processors or image datasets",
}
"""Node-id parts (a class or a test) the harness skips, with the reason."""

if not MODE:
    collect_ignore = [UPSTREAM]
else:
    collect_ignore = ["test_harness.py"]  # the harness's own tests run in `make test`; a mode counts TRL's only
    sys.path.insert(0, str(HERE))
    if MODE not in MODES:
        raise pytest.UsageError(f"{MODE_ENV} must be one of {MODES}, got {MODE!r}")
    if not (HERE / UPSTREAM / f"{TEST_MODULE}.py").exists():
        raise pytest.UsageError(f"{HERE / UPSTREAM} holds no {TEST_MODULE}.py: copy it in first (README.md)")
    if "huggingface_hub" in sys.modules:
        raise pytest.UsageError("huggingface_hub was imported before the harness set HF_HUB_CACHE")
    HUB = Path(os.environ.get(HUB_ENV) or tempfile.mkdtemp(prefix="trl-suite-hub-"))
    os.environ.update(HF_HUB_CACHE=str(HUB / "cache"), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                      TRANSFORMERS_OFFLINE="1", HF_MODULES_CACHE=str(HUB / "modules"),
                      HF_DATASETS_CACHE=str(HUB / "datasets"))


def pytest_configure(config):
    """Build the tiny hub (once per `TRL_SUITE_HUB` directory) and check the hub client reads it."""
    if not MODE:
        return
    import tiny_hub

    done = HUB / "built"
    if not done.exists():
        tiny_hub.build_hub(HUB / "cache", HUB / "work")
        done.write_text("\n".join(tiny_hub.MODELS) + "\n")
    from huggingface_hub import constants

    if Path(constants.HF_HUB_CACHE) != HUB / "cache" or not constants.HF_HUB_OFFLINE:
        raise pytest.UsageError(f"huggingface_hub reads {constants.HF_HUB_CACHE}, not the tiny hub {HUB}")
    add_missing_probes()


def add_missing_probes() -> list[str]:
    """Add to `trl.import_utils` each `is_<package>_available` the vendored files import from it that the
    installed TRL does not define (the snapshot's TRL has more of them): `find_spec(<package>)`, what TRL's own
    probes check. Returns the names added."""
    import ast
    import importlib
    import importlib.util
    import re

    probes = importlib.import_module("trl.import_utils")  # trl is a lazy module: no attribute access
    added = []
    for path in (HERE / UPSTREAM).glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "trl.import_utils":
                for alias in node.names:
                    match = re.fullmatch(r"is_(\w+)_available", alias.name)
                    if match and not hasattr(probes, alias.name):
                        package = match.group(1)
                        setattr(probes, alias.name,
                                lambda package=package: importlib.util.find_spec(package) is not None)
                        added.append(alias.name)
    return added


def pytest_report_header(config):
    if MODE:
        return f"trl suite: mode {MODE}, tiny hub {HUB}"


def pytest_collection_modifyitems(config, items):
    """Point the vendored module's names at the harness (module docstring) and apply `SKIPS`."""
    if not MODE:
        return
    import datasets
    import tiny_hub
    from modes import mode_classes

    trainer, grpo_config = mode_classes(MODE)
    datasets.load_dataset = tiny_hub.load_dataset
    for module in {item.module for item in items if item.module.__name__.endswith(f"{UPSTREAM}.{TEST_MODULE}")}:
        module.load_dataset = tiny_hub.load_dataset
        module.GRPOTrainer, module.GRPOConfig = trainer, grpo_config
    for item in items:
        for part, reason in SKIPS.items():
            if part in item.nodeid.split("::"):
                item.add_marker(pytest.mark.skip(reason=f"harness: {reason}"))
