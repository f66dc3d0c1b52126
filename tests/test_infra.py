"""infra/ and prefect.yaml cannot run here (no Docker, no Kubernetes): parse them and check they agree
with infra/services.yaml, the one place the local stack also reads."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import yaml
from helpers import REPO_ROOT, free_port_base

from rcgrpo_tasks.ops import stack, stack_state

INFRA = REPO_ROOT / "infra"


@pytest.fixture(scope="module")
def services():
    return stack_state.load_services()


@pytest.fixture(scope="module")
def compose():
    return yaml.safe_load((INFRA / "docker-compose.yml").read_text())


def _env(service: dict) -> dict:
    env = service.get("environment", {})
    return dict(e.split("=", 1) for e in env) if isinstance(env, list) else env


def test_compose_services_ports_and_env_match_services_yaml(services, compose):
    svc = compose["services"]
    assert {"postgres", "s3", "mlflow", "prefect-server", "prefect-services", "worker-cpu"} <= set(svc)
    for name, spec in services["services"].items():
        port = spec["port"]
        assert f"{port}:{port}" in svc[spec["compose"]]["ports"], (name, svc[spec["compose"]].get("ports"))
    local = stack_state.Stack(Path("/nonexistent"), stack_state.default_ports(services), services=services)
    hosts = {name: spec["compose"] for name, spec in services["services"].items()}
    want = {k: local.fill(v, hosts) for k, v in services["client_env"].items()}
    worker_env = _env(svc["worker-cpu"])
    for key, value in want.items():
        if key != "AWS_DEFAULT_REGION":
            assert worker_env.get(key) == value, key
    mlflow_env = _env(svc["mlflow"])
    for key, value in services["mlflow_server_env"].items():
        assert mlflow_env[key] == local.fill(value, hosts)
    prefect_env = _env(svc["prefect-server"])
    for key, value in services["prefect_server_env"].items():
        assert prefect_env[key] == local.fill(value, hosts), key
    cmd = svc["mlflow"]["command"]
    assert f"--port {services['services']['mlflow']['port']}" in cmd
    assert f"s3://{services['bucket']}/{services['mlflow_prefix']}" in cmd
    assert f"-s3.port={services['services']['s3']['port']}" in " ".join(svc["s3"]["command"])
    assert f"--port {services['services']['prefect']['port']}" in svc["prefect-server"]["command"]
    assert services["work_pools"]["cpu"] in svc["worker-cpu"]["command"]


def test_compose_takes_credentials_only_from_the_environment(compose):
    text = (INFRA / "docker-compose.yml").read_text()
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "POSTGRES_PASSWORD"):
        for line in text.splitlines():
            m = re.match(rf"\s*{key}:\s*(.+)$", line)
            if m:
                assert m.group(1).startswith("${"), line
    for url in re.findall(r"postgres(?:ql)?(?:\+asyncpg)?://[^\s\"']+", text):
        assert "${POSTGRES_PASSWORD" in url, url
    for svc_name, svc in compose["services"].items():
        for dep in (svc.get("depends_on") or {}):
            assert dep in compose["services"], (svc_name, dep)
        build = svc.get("build")
        if build:
            assert (REPO_ROOT / build["dockerfile"]).is_file()


def test_prefect_yaml_deployments(services):
    import prefect

    cfg = yaml.safe_load((REPO_ROOT / "prefect.yaml").read_text())
    assert cfg["prefect-version"] == prefect.__version__
    deps = {d["name"]: d for d in cfg["deployments"]}
    assert {"full", "full-gpu", "retrain"} <= set(deps)
    for d in deps.values():
        path, func = d["entrypoint"].split(":")
        src = (REPO_ROOT / path).read_text()
        assert f"def {func}(" in src and f'@flow(name="{func}"' in src
        if func == "stage":  # one stage of a parent's run: the parent names the profile, the deployment the repo
            assert d["parameters"]["repository"] == "{{ $RCGRPO_GIT_URL }}", d["name"]
            assert d["work_pool"]["job_variables"]["env"]["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"] == "30"
            assert d["pull"] == [{"prefect.deployments.steps.set_working_directory":
                                  {"directory": "{{ $RCGRPO_CODE_DIR }}"}}]
            assert d["work_pool"]["name"] == services["work_pools"][d["name"]]
            continue
        assert (d.get("parameters") or {}).get("profile"), f"{d['name']}: every deployment pins its profile"
    assert deps["full"]["work_pool"]["name"] == services["work_pools"]["cpu"]
    assert deps["full-gpu"]["work_pool"]["name"] == services["work_pools"]["gpu"]
    assert deps["full-gpu"]["parameters"]["profile"] == "gpu"  # the one-GPU profile: no model hub needed
    assert deps["grid"]["parameters"]["dispatch"] == "pools"
    assert deps["grid"]["work_pool"]["name"] == services["work_pools"]["control"]
    assert not deps["full"].get("schedules"), "the weekly cron retrains (deployment `retrain`), not `full`"
    (weekly,) = deps["retrain"]["schedules"]
    assert weekly["active"] is False
    fields = weekly["cron"].split()
    assert len(fields) == 5 and fields[2] == "*" and fields[3] == "*" and fields[4] != "*"
    from prefect.client.schemas.schedules import CronSchedule

    CronSchedule(cron=weekly["cron"], timezone=weekly["timezone"])  # parses
    text = (REPO_ROOT / "prefect.yaml").read_text()
    assert "AWS_SECRET" not in text and "PASSWORD" not in text


def test_flow_parameters_are_typed_and_deployment_params_valid():
    import sys

    sys.path.insert(0, str(REPO_ROOT))
    from flows.rcgrpo_flow import rcgrpo
    from flows.retrain_flow import retrain
    from flows.stage_flow import stage

    flows = {"rcgrpo": rcgrpo, "retrain": retrain, "stage": stage}
    assert {"profile", "stages", "force", "push"} <= set(rcgrpo.parameters.model_dump()["properties"])
    cfg = yaml.safe_load((REPO_ROOT / "prefect.yaml").read_text())
    for d in cfg["deployments"]:
        schema = flows[d["entrypoint"].split(":")[1]].parameters.model_dump()["properties"]
        assert set(d.get("parameters") or {}) <= set(schema), d["name"]


def test_k8s_gpu_template_requests_gpus():
    from prefect.utilities.templating import apply_values

    tpl = json.loads((INFRA / "k8s" / "gpu-base-job-template.json").read_text())
    props = tpl["variables"]["properties"]
    defaults = {k: v["default"] for k, v in props.items() if "default" in v}
    job = apply_values(tpl["job_configuration"], {**defaults, "env": {}, "command": "x", "name": "n"})
    container = job["job_manifest"]["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert container["envFrom"][0]["secretRef"]["name"] == "rcgrpo-credentials"
    assert container["name"] == "prefect-job" and job["job_manifest"]["kind"] == "Job"


def test_images_and_readme_cover_each_path(services):
    gpu = (INFRA / "gpu-worker.Dockerfile").read_text()
    assert "VLLM_EXTRA=gpu" in gpu and services["work_pools"]["gpu"] in gpu  # the `[gpu]` extra, by `make vllm-venv`
    assert services["work_pools"]["cpu"] in (INFRA / "worker.Dockerfile").read_text()
    readme = (INFRA / "README.md").read_text()
    for section in ("Local stack", "Docker Compose", "GPU host", "Kubernetes"):
        assert f"## {section}" in readme, section


def test_stack_stops_only_what_it_started(tmp_path):
    """`down` touches a pid only if its start time matches the record (a recycled pid is left alone)."""
    import socket

    s = stack_state.Stack(tmp_path, stack_state.default_ports(stack_state.load_services(), free_port_base()))
    rec = stack_state.spawn(s, "worker", ["sleep", "60"], {"PATH": "/usr/bin:/bin"})
    try:
        state = {"ports": s.ports, "procs": {"worker": dict(rec, create_time=rec["create_time"] - 1000)}}
        stack_state.write_state(s, state)
        assert stack.down(s) == ["worker"] and stack_state.alive(rec), "killed a process it did not start"
        stack_state.write_state(s, {"ports": s.ports, "procs": {"worker": rec}})
        assert (tmp_path / "pids" / "worker.pid").read_text().strip() == str(rec["pid"])
        assert stack.down(s) == ["worker"]
        assert not stack_state.alive(rec)
        assert json.loads((tmp_path / "stack.json").read_text())["procs"] == {}
    finally:
        if stack_state.alive(rec):
            os.kill(rec["pid"], 9)
    with socket.socket() as busy:  # a port already taken fails fast, naming the port
        busy.bind(("127.0.0.1", s.ports["mlflow"]))
        busy.listen()
        with pytest.raises(stack_state.StackError, match=f"port {s.ports['mlflow']} .*busy"):
            stack._check_ports(s, "mlflow")


def test_stack_requires_credentials_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID", raising=False)
    s = stack_state.make_stack(tmp_path / "state", port_base=free_port_base())
    with pytest.raises(stack_state.StackError, match="AWS_ACCESS_KEY_ID"):
        stack.up(s)
    assert not (tmp_path / "state" / "stack.json").exists()
