"""The multi-GPU recipe (docs/multi-gpu.md) checked as far as a CPU can: the accelerate and DeepSpeed configs
through accelerate's own code, the launches the paper profile and the doc make through `accelerate launch`'s
own parsing and environment set-up (nothing is started), the batch arithmetic through the project's config
loaders and `check_world`, the vLLM server line through TRL's parser, and the Kubernetes pool the `full-gpu`
deployment runs on. NCCL, DeepSpeed itself and vLLM are not exercised."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
from pathlib import Path

import pytest
import yaml
from helpers import REPO_ROOT, config_from_params, k8s_manifest, write_params

from rcgrpo_tasks.engine.compute import ComputeConfig, load_compute
from rcgrpo_tasks.ops.config import ConfigError, load_config
from rcgrpo_tasks.ops.profiles import apply_profile
from rcgrpo_tasks.train.rl.config import RLConfig, check_world
from rcgrpo_tasks.train.sft.run import load_sft_config

DOC = REPO_ROOT / "docs" / "multi-gpu.md"
TEMPLATE = REPO_ROOT / "infra" / "k8s" / "gpu-base-job-template.json"
DISTRIBUTED_TYPE = {"accelerate_multi_gpu.yaml": "MULTI_GPU", "accelerate_zero3.yaml": "DEEPSPEED"}
PAPER_SFT_BATCH = 16
"""The paper's SFT batch (configs/paper.yaml): micro-batch x accumulation x processes."""


def _profile(out: Path, profile: str) -> Path:
    apply_profile(None, profile, out, root=REPO_ROOT)  # what `rcgrpo params --profile ... --out` writes
    return out


@pytest.fixture(scope="module")
def paper(tmp_path_factory) -> Path:
    return _profile(tmp_path_factory.mktemp("paper") / "params.yaml", "paper")


def _paper_with(tmp_path: Path, overlay: dict | str) -> Path:
    """The paper params with `overlay` layered over them (`rcgrpo params --profile paper+<overlay>.yaml`)."""
    path = tmp_path / "overlay.yaml"
    path.write_text(overlay if isinstance(overlay, str) else yaml.safe_dump(overlay))
    return _profile(tmp_path / "params.yaml", f"paper+{path}")


def _sft_batch(params: Path) -> set[int]:
    processes = load_compute(params).processes
    return {cfg.batch_size * cfg.grad_accum * processes
            for cfg in (load_sft_config(params, v)[0] for v in ("sft", "rctp"))}


def _doc_commands(program: str) -> list[tuple[dict, list[str]]]:
    """(VAR=value prefixes, arguments) of every command in docs/multi-gpu.md's bash blocks that runs
    `program`: continuation lines joined, comments dropped, `$VAR` set by an earlier line expanded."""
    found, shell = [], {}
    for block in re.findall(r"```bash\n(.*?)```", DOC.read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = [w for w in shlex.split(line, comments=True) if w != "&"]
            env = {}
            while words and re.match(r"^[A-Z_]+=", words[0]):
                key, value = words.pop(0).split("=", 1)
                env[key] = value
            if not words:
                shell.update(env)
                continue
            words = [re.sub(r"\$(\w+)", lambda m: shell[m.group(1)], w) for w in words]
            head = program.split()
            if words[: len(head)] == head:
                found.append((env, words[len(head):]))
    assert found, f"{DOC.name}: no `{program}` command"
    return found


def _option(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def _accelerate_launch(argv: list[str], monkeypatch) -> tuple:
    """(args, environment) that `accelerate launch *argv` would give its processes, through accelerate's own
    parser, config merge and environment set-up (as `launch_command` does; nothing is started)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import launch as acc_launch

    monkeypatch.setattr(acc_launch, "is_port_in_use", lambda port: False)  # rank 0 probes its port
    args, defaults, mp_from_config = _validate_launch_command(launch_command_parser().parse_args(argv))
    if args.use_deepspeed:
        fields = list(defaults.deepspeed_config) if defaults else []
        args.deepspeed_fields_from_accelerate_config = ",".join(fields + ["mixed_precision"] * mp_from_config)
        return args, acc_launch.prepare_deepspeed_cmd_env(args)[1]
    return args, acc_launch.prepare_multi_gpu_env(args)


def _deepspeed_plugin(env: dict, monkeypatch):
    """The DeepSpeed plugin a launched process builds from its environment (accelerate's own class; it needs
    no deepspeed package)."""
    from accelerate.utils import DeepSpeedPlugin

    for key in [k for k in os.environ if k.startswith("ACCELERATE_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        if key.startswith("ACCELERATE_"):
            monkeypatch.setenv(key, value)
    return DeepSpeedPlugin()


def _assert_zero3(plugin) -> None:
    assert plugin.zero_stage == 3 and plugin.hf_ds_config.is_zero3() and not plugin.hf_ds_config.is_offload()
    assert plugin.zero3_init_flag  # the 7B model is loaded sharded, never whole on one GPU
    assert plugin.zero3_save_16bit_model  # the final save gathers the shards into a loadable model
    # Batch, optimizer, clipping and precision come from the stage's params, never from the JSON.
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size",
                "gradient_clipping", "optimizer.params.lr", "bf16.enabled"):
        assert plugin.is_auto(key), key


# ---------------------------------------------------------------- accelerate and DeepSpeed configs


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO_ROOT / "configs").glob("accelerate_*.yaml")))
def test_accelerate_config_loads_through_accelerate(name):
    from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file

    assert name in DISTRIBUTED_TYPE, f"configs/{name}: add its expected distributed_type here"
    cfg = load_config_from_file(str(REPO_ROOT / "configs" / name))  # unknown keys raise
    assert isinstance(cfg, ClusterConfig) and cfg.distributed_type.value == DISTRIBUTED_TYPE[name]
    assert cfg.num_machines == 1 and not cfg.use_cpu
    if cfg.distributed_type.value == "DEEPSPEED":
        assert (REPO_ROOT / cfg.deepspeed_config["deepspeed_config_file"]).is_file()
        # With a DeepSpeed JSON, accelerate refuses precision / stage / offload set beside it in the config.
        assert "mixed_precision" not in yaml.safe_load((REPO_ROOT / "configs" / name).read_text())


def test_paper_launch_is_deepspeed_zero3_over_8_processes(paper, monkeypatch):
    import torch

    from rcgrpo_tasks.train.common import distributed

    monkeypatch.chdir(REPO_ROOT)  # the config paths are relative to the repo, as under `dvc repro`
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    compute = load_compute(paper)
    assert compute.processes == 8 and compute.accelerate_config == "configs/accelerate_zero3.yaml"
    assert distributed.should_launch(compute)
    cmd = distributed.launch_command(compute, torch.device("cuda"), ["rl", "--params", "params.yaml"])
    args, env = _accelerate_launch(cmd[cmd.index("accelerate.commands.launch") + 1:], monkeypatch)
    assert args.use_deepspeed and not args.multi_gpu and args.num_processes == 8 and args.nproc_per_node == "8"
    assert args.module and args.training_script == "rcgrpo_tasks.cli" and args.training_script_args[0] == "rl"
    assert env["ACCELERATE_DEEPSPEED_CONFIG_FILE"] == "configs/ds_zero3.json"
    _assert_zero3(_deepspeed_plugin(env, monkeypatch))
    assert load_config(RLConfig, paper, "rl").deepspeed == "configs/ds_zero3.json"


# ---------------------------------------------------------------- batches across processes


def test_paper_batches_split_over_8_processes(paper):
    compute = load_compute(paper)
    assert (REPO_ROOT / compute.accelerate_config).is_file()
    rl = load_config(RLConfig, paper, "rl")
    assert rl.batch_size == 256 * rl.num_generations == 1280  # 256 prompts x G=5
    assert check_world(rl, compute.processes) == 20  # 160 rollouts = 32 groups per process, micro 8
    assert check_world(rl, 16) == 10  # two nodes (docs/multi-gpu.md)
    assert _sft_batch(paper) == {PAPER_SFT_BATCH}  # 2 x 1 x 8


def test_batches_that_straddle_processes_are_refused(paper, tmp_path):
    rl = load_config(RLConfig, paper, "rl")
    with pytest.raises(ConfigError, match="whole groups"):
        check_world(rl, 6)  # 213.3 rollouts per process: why the vLLM server split is 4 + 4
    cases = [
        {"batch_size": 1300, "micro_batch_size": 4},  # 260 prompts: 162.5 rollouts per process
        {"num_generations": 4, "batch_size": 1272},  # 159 rollouts per process: a group of 4 would straddle two
        {"micro_batch_size": 64},  # 160 rollouts per process: not whole micro-batches of 64
    ]
    for i, rl_overlay in enumerate(cases):
        folder = tmp_path / str(i)
        folder.mkdir()
        cfg = load_config(RLConfig, _paper_with(folder, {"rl": rl_overlay}), "rl")  # valid on one process
        check_world(cfg, 1)
        with pytest.raises(ConfigError, match=r"must split into 8 process\(es\) of whole groups"):
            check_world(cfg, 8)


def test_documented_vllm_server_split(tmp_path):
    from trl import GRPOConfig
    from trl.scripts.utils import TrlParser
    from trl.scripts.vllm_serve import ScriptArguments

    (overlay,) = re.findall(r"```yaml\n(.*?)```", DOC.read_text(), re.S)
    params = _paper_with(tmp_path, overlay)
    compute, rl = load_compute(params), load_config(RLConfig, params, "rl")
    assert compute.processes == 4 and rl.use_vllm and rl.vllm_mode == "server"
    assert check_world(rl, compute.processes) == 40 and _sft_batch(params) == {PAPER_SFT_BATCH}
    assert set(rl.extra) <= {f.name for f in dataclasses.fields(GRPOConfig)}  # TRL would refuse a typo
    assert rl.extra["vllm_max_model_length"] == 32768  # the overlay's `extra` merges with the profile's
    serving = set()
    for env, argv in _doc_commands("trl vllm-serve"):
        (served,) = TrlParser(ScriptArguments).parse_args_and_config(argv)
        gpus = env["CUDA_VISIBLE_DEVICES"].split(",")
        assert served.tensor_parallel_size * served.data_parallel_size == len(gpus)
        assert served.port == rl.extra["vllm_server_port"] and served.max_model_len == rl.extra["vllm_max_model_length"]
        assert re.fullmatch(r"models/sft/sft|models/rctp/\d+", served.model)  # an init of the RL grid
        serving |= set(gpus)
    training = [env["CUDA_VISIBLE_DEVICES"].split(",") for env, _ in _doc_commands("dvc repro") if env]
    assert training and all(len(g) == compute.processes and not set(g) & serving for g in training)


# ---------------------------------------------------------------- several nodes


def test_documented_multi_node_launch(paper, monkeypatch):
    monkeypatch.chdir(REPO_ROOT)
    rl = load_config(RLConfig, paper, "rl")
    stage_cmd = yaml.safe_load((REPO_ROOT / "dvc.yaml").read_text())["stages"]["rl_rctp"]["cmd"]
    ranks = {}
    for _, argv in _doc_commands("accelerate launch"):
        args, env = _accelerate_launch(argv, monkeypatch)
        ranks[args.machine_rank] = args
        assert args.use_deepspeed and args.num_machines == 2 and args.nproc_per_node == "8"
        assert args.node_rank == args.machine_rank
        _assert_zero3(_deepspeed_plugin(env, monkeypatch))
        assert check_world(rl, args.num_processes) == 10
        # The module command is the rl stage's own command from dvc.yaml for that cell.
        assert args.module and args.training_script == "rcgrpo_tasks.cli"
        assert _option(argv, "--init") == "rctp"
        cell = stage_cmd.replace("${item.algo}", _option(argv, "--algo")).replace("${item.seed}", _option(argv, "--grid-seed"))
        expected = shlex.split(cell)
        assert expected[0] == "rcgrpo" and args.training_script_args == expected[1:]
    assert sorted(ranks) == [0, 1]
    assert len({(a.main_process_ip, a.main_process_port, a.num_processes) for a in ranks.values()}) == 1
    assert ranks[0].main_process_ip not in (None, "", "localhost", "127.0.0.1")  # reachable from node 1


# ---------------------------------------------------------------- Kubernetes


def test_full_gpu_runs_on_a_kubernetes_pool_of_8_gpus():
    from prefect.utilities.schema_tools.validation import ValidationError, validate

    tpl = json.loads(TEMPLATE.read_text())
    deployments = {d["name"]: d for d in yaml.safe_load((REPO_ROOT / "prefect.yaml").read_text())["deployments"]}
    pool = deployments["full-gpu"]["work_pool"]
    ((_, create),) = _doc_commands("prefect work-pool create")
    assert create[0] == pool["name"] and _option(create, "--type") == "kubernetes"
    assert REPO_ROOT / _option(create, "--base-job-template") == TEMPLATE
    runs = [argv for _, argv in _doc_commands("prefect deployment run") if "profile=paper" in argv]
    assert runs and all(argv[0] == "rcgrpo/full-gpu" for argv in runs)
    for argv in runs:
        given = dict(argv[i + 1].split("=", 1) for i, w in enumerate(argv) if w == "--job-variable")
        variables = {**pool.get("job_variables", {}), **{k: json.loads(v) for k, v in given.items()}}
        props = tpl["variables"]["properties"]
        assert set(variables) <= set(props)  # the schema admits unknown keys, which the template would ignore
        validate(variables, tpl["variables"], raise_on_error=True)  # what the server checks on a run
        with pytest.raises(ValidationError, match="gpu_count"):
            validate({**variables, "gpu_count": 0}, tpl["variables"], raise_on_error=True)
        (container,) = k8s_manifest(tpl, variables, "full-gpu")["spec"]["template"]["spec"]["containers"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
        assert container["resources"]["requests"]["nvidia.com/gpu"] == 8
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert variables["env"].items() <= env.items()  # RCGRPO_DVC_REMOTE_URL reaches the flow run


# ---------------------------------------------------------------- the compute section


@pytest.mark.parametrize("section, message", [
    ({"processes": 0}, "processes"),
    ({"processes": True}, "processes"),
    ({"processes": "8"}, "processes"),
    ({"accelerate_config": ""}, "accelerate_config"),
    ({"accelerate_config": "  "}, "accelerate_config"),
])
def test_compute_refuses_bad_launch_settings(tmp_path, section, message):
    params = tmp_path / "params.yaml"
    write_params(params, {"compute": section})
    with pytest.raises(ConfigError, match=rf"params.yaml:compute.*{message}"):
        load_compute(params)
    with pytest.raises(ValueError, match=message):
        config_from_params(ComputeConfig, "compute", **section)
