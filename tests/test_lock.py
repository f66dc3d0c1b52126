"""dvc.lock records exactly the pipeline's stages: a stage renamed or dropped from dvc.yaml leaves no entry
behind pointing at deleted code and outputs (DVC keeps such entries until the lock is rewritten)."""

from __future__ import annotations

import yaml
from helpers import REPO_ROOT

from rcgrpo_tasks.ops.pipeline import dvc_stages


def test_dvc_lock_holds_exactly_the_pipelines_stages():
    lock = yaml.safe_load((REPO_ROOT / "dvc.lock").read_text())["stages"]
    names = {s.name for s in dvc_stages(REPO_ROOT, with_status=False)}
    assert set(lock) == names, {"orphans in dvc.lock": sorted(set(lock) - names),
                                "stages dvc.lock lacks": sorted(names - set(lock))}
