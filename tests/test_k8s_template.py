"""The Kubernetes job templates of infra/k8s rendered by prefect-kubernetes' own code, as its worker renders them for
a stage run (no cluster): the work pool's base job template, the stage deployment's job variables (prefect.yaml)
and the run's own (what the grid's parent sets from the stage's params `resources`: `flows.grid.gpu_variables`)
into `KubernetesWorkerJobConfiguration`, then `prepare_for_flow_run`. Checked: a GPU stage's Job requests and
limits exactly its declared `nvidia.com/gpu` count, a CPU stage's Job requests none, both pods take their S3
keys from the secret (never from env values) and run the stage flow from the image's code in a worker
directory of their own."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml
from helpers import REPO_ROOT, k8s_manifest

sys.path.insert(0, str(REPO_ROOT))
pytest.importorskip("prefect_kubernetes")
from flows.grid import gpu_variables  # noqa: E402
from rcgrpo_tasks.ops.pipeline import PlannedStage  # noqa: E402
from rcgrpo_tasks.ops.resources import resources_of  # noqa: E402

K8S = REPO_ROOT / "infra" / "k8s"


class Pool:
    def __init__(self, template: dict):
        self.base_job_template = template


def render(template_file: str, stage: PlannedStage, deployment: str) -> dict:
    """The Job manifest prefect-kubernetes' worker would submit for `stage` through stage deployment `deployment`."""
    template = json.loads((K8S / template_file).read_text())
    deploy = next(d for d in yaml.safe_load((REPO_ROOT / "prefect.yaml").read_text())["deployments"]
                  if d["name"] == deployment)
    values = {**deploy["work_pool"].get("job_variables", {}), **gpu_variables(Pool(template), stage.gpus)}
    return k8s_manifest(template, values, stage.name)


def stage_under(profile: str, name: str) -> PlannedStage:
    """The stage `name` as `rcgrpo plan` plans it under `profile` (its GPUs from the profile's `resources`)."""
    from rcgrpo_tasks.ops.config import deep_merge

    params = deep_merge(yaml.safe_load((REPO_ROOT / "params.yaml").read_text()),
                        yaml.safe_load((REPO_ROOT / "configs" / f"{profile}.yaml").read_text()))
    return PlannedStage(name, ("rcgrpo ...",), (), (), gpus=resources_of(params, profile).of(name).gpus)


def container(manifest: dict) -> dict:
    return manifest["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize(("profile", "name", "gpus"), [("paper", "rl_rctp@0-rc_grpo", 8), ("paper", "evaluate@base", 1),
                                                       ("gpu", "rl_rctp@0-grpo", 1)])
def test_a_gpu_stage_job_requests_its_declared_gpus(profile, name, gpus):
    stage = stage_under(profile, name)
    assert stage.gpus == gpus
    manifest = render("gpu-base-job-template.json", stage, "gpu")
    print(json.dumps(manifest, indent=1))
    resources = container(manifest)["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == gpus and resources["limits"]["nvidia.com/gpu"] == gpus
    _common(manifest)


def test_a_cpu_stage_job_requests_no_gpu():
    stage = stage_under("paper", "generate_trajectories")
    assert stage.gpus == 0 and gpu_variables(Pool({}), 0) == {}
    manifest = render("cpu-base-job-template.json", stage, "cpu")
    assert "nvidia.com/gpu" not in json.dumps(container(manifest)["resources"])
    assert "tolerations" not in manifest["spec"]["template"]["spec"]
    _common(manifest)


def _common(manifest: dict) -> None:
    box = container(manifest)
    env = {e["name"]: e.get("value") for e in box["env"]}
    assert env["RCGRPO_CODE_DIR"] == "/opt/rcgrpo" and env["RCGRPO_WORKER_DIR"] == "/work"
    assert env["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"] == "30"  # the stage deployment's: a dead pod is CRASHED
    assert not {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} & set(env)
    assert box["envFrom"] == [{"secretRef": {"name": "rcgrpo-credentials"}}]
    assert {"name": "work", "mountPath": "/work"} in box["volumeMounts"]
    assert manifest["spec"]["backoffLimit"] == 0  # a failed stage is the parent's to run again, not the Job's
    assert Path(REPO_ROOT / "flows" / "stage_flow.py").is_file()
