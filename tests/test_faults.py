"""Faults that must neither lose nor hide work: params.yaml edited while a stage runs, a damaged newest
checkpoint, a full disk inside torch's checkpoint writer, an output budget beyond the model's context, and a
stopped flow's record."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from helpers import (
    LEVELS,
    REPO_ROOT,
    chat,
    compute_from_params,
    config_from_params,
    params_section,
    tiny_sft_config,
    write_params,
)

from rcgrpo_tasks.engine.decoding import PROMPT_FLOOR, DecodeConfig
from rcgrpo_tasks.ops import tracking
from rcgrpo_tasks.ops.config import ConfigError, ParamsChanged, load_config, load_keys, read_sections
from rcgrpo_tasks.ops.outputs import OutputError, write_jsonl
from rcgrpo_tasks.train.common import checkpoints, runs
from rcgrpo_tasks.train.sft import config as sft_config
from rcgrpo_tasks.train.sft import run as sft_run

# ------------------------------------------------------------------------------ params edited under a stage


@pytest.fixture()
def params_file(tmp_path) -> Path:
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump({"prepare_data": params_section("prepare_data"), "rl": {"lr": 1.0}}))
    return path


def _edit(path: Path, section: str, key: str, value) -> None:
    data = yaml.safe_load(path.read_text())
    data[section][key] = value
    path.write_text(yaml.safe_dump(data))


def test_params_edited_under_a_stage_publish_nothing(params_file, tmp_path):
    from rcgrpo_tasks.env.split import PrepareDataConfig

    load_config(PrepareDataConfig, params_file, "prepare_data")
    out = tmp_path / "out" / "entries.jsonl"
    with pytest.raises(ParamsChanged) as info:
        with tracking.published_run("prepare_data", outputs=(out,), track=False) as (_, staged):
            write_jsonl(staged.file(out), [{"a": 1}])
            _edit(params_file, "prepare_data", "seed", 1)
    message = str(info.value)
    assert "prepare_data.seed (0 -> 1)" in message and str(params_file) in message and "\n" not in message
    assert not out.exists() and not list(tmp_path.glob("out/.*"))  # no output, no temp left


def test_an_edit_to_a_section_the_stage_did_not_read_does_not_block_it(params_file, tmp_path):
    from rcgrpo_tasks.env.split import PrepareDataConfig

    load_config(PrepareDataConfig, params_file, "prepare_data")
    assert read_sections(params_file, "compute") == {}  # read while absent: still absent at publication
    out = tmp_path / "m.json"
    with tracking.published_run("prepare_data", outputs=(out,), track=False) as (_, staged):
        staged.file(out).write_text("{}")
        _edit(params_file, "rl", "lr", 2.0)
    assert out.read_text() == "{}"
    params_file.write_text(params_file.read_text() + "compute:\n  device: cpu\n")
    with pytest.raises(ParamsChanged, match=r"compute \(absent -> \{'device': 'cpu'\}\)"):
        with tracking.published_run("prepare_data", outputs=(out,), track=False):
            pass


def test_a_stage_that_read_keys_of_a_section_is_blocked_by_those_keys_only(params_file, tmp_path):
    """`load_keys` remembers each key it read: another key of the section may change, that one may not."""
    @dataclasses.dataclass(frozen=True)
    class Lr:
        lr: float

    assert load_keys(Lr, params_file, "rl").lr == 1.0
    _edit(params_file, "rl", "other", 3)
    out = tmp_path / "m.json"
    with tracking.published_run("evaluate", outputs=(out,), track=False) as (_, staged):
        staged.file(out).write_text("{}")
    with pytest.raises(ParamsChanged, match=r"rl\.lr \(1\.0 -> 2\.0\)"):
        with tracking.published_run("evaluate", outputs=(tmp_path / "n.json",), track=False):
            _edit(params_file, "rl", "lr", 2.0)


def test_a_tracked_stage_run_ends_failed_naming_the_changed_key(store, params_file, tmp_path):
    import mlflow

    from rcgrpo_tasks.env.split import PrepareDataConfig

    load_config(PrepareDataConfig, params_file, "prepare_data")
    out = tmp_path / "metrics.json"
    with pytest.raises(ParamsChanged):
        with tracking.published_run("prepare_data", outputs=(out,)) as (run, staged):
            staged.file(out).write_text("{}")
            _edit(params_file, "prepare_data", "test_fraction", 0.2)
    got = mlflow.MlflowClient().get_run(run.info.run_id)
    assert got.info.status == "FAILED" and not out.exists()
    assert "prepare_data.test_fraction (0.1 -> 0.2)" in got.data.tags[tracking.ERROR_TAG]


def test_stage_code_reads_params_only_in_ways_that_are_checked():
    """`read_params` returns the whole file unremembered: a stage reading through it would escape the check."""
    library = REPO_ROOT / "rcgrpo_tasks"
    users = [str(f.relative_to(library)) for layer in ("stages", "evaluation", "train", "data", "engine")
             for f in sorted((library / layer).glob("*.py")) if "read_params(" in f.read_text()]
    assert users == []


HOOK = '''\
"""`rcgrpo prepare-data` with params.yaml edited after the stage read it (when RCGRPO_TEST_EDIT is set)."""
import dataclasses
import os
import sys
from pathlib import Path

import yaml

from rcgrpo_tasks import cli
from rcgrpo_tasks.stages import prepare_data as stage

real = stage.prepare


def prepare(config):
    out = real(config)
    if os.environ.get("RCGRPO_TEST_EDIT"):
        params = yaml.safe_load(Path("params.yaml").read_text())
        params["prepare_data"]["seed"] += 1
        Path("params.yaml").write_text(yaml.safe_dump(params))
    return out


stage.prepare = prepare
sys.exit(cli.main(sys.argv[1:]))
'''


def _dvc(repo: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(Path(sys.executable).with_name("dvc")), *args], cwd=repo, capture_output=True,
                          text=True, timeout=300, env={**os.environ, **(env or {})})


def test_dvc_never_records_results_made_with_params_edited_under_them(tmp_path):
    """A real stage under `dvc repro`, params.yaml edited between its read and its publication: the stage
    fails naming the key, nothing is published, dvc.lock and the run cache stay empty and `dvc status` does not
    call the stage up to date; the rerun then records the values its results were made with."""
    repo = tmp_path / "repo"
    repo.mkdir()
    section = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())["prepare_data"]
    (repo / "params.yaml").write_text(yaml.safe_dump({"prepare_data": {**section, "seed": 0}}))
    (repo / "hook.py").write_text(HOOK)
    (repo / "dvc.yaml").write_text(textwrap.dedent(f"""\
        stages:
          prepare_data:
            cmd: {sys.executable} hook.py prepare-data --params params.yaml --entries data/entries.jsonl
              --split data/split.json
            params: [prepare_data]
            outs: [data/entries.jsonl, data/split.json]
        """))
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    assert _dvc(repo, "init", "-q").returncode == 0
    edited = _dvc(repo, "repro", env={"RCGRPO_TEST_EDIT": "1", "PYTHONHASHSEED": "0"})
    assert edited.returncode != 0
    assert "params changed while prepare_data ran: params.yaml:prepare_data.seed (0 -> 1)" in edited.stderr
    assert not (repo / "data" / "entries.jsonl").exists() and not (repo / "dvc.lock").exists()
    assert not list((repo / ".dvc" / "cache").rglob("runs/*/*/*"))  # nothing in DVC's run cache
    status = _dvc(repo, "status")
    assert "up to date" not in status.stdout and "prepare_data" in status.stdout

    again = _dvc(repo, "repro", env={"PYTHONHASHSEED": "0"})
    assert again.returncode == 0, again.stderr
    lock = yaml.safe_load((repo / "dvc.lock").read_text())
    assert lock["stages"]["prepare_data"]["params"]["params.yaml"]["prepare_data"]["seed"] == 1
    assert "up to date" in _dvc(repo, "status").stdout


# ------------------------------------------------------------------------------ a damaged newest checkpoint


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_model_dir):
    """A tiny SFT run that kept checkpoints 1, 2 and 3; (its config, a spec, the pristine checkpoints)."""
    root = tmp_path_factory.mktemp("ckpt_run")
    write_jsonl(root / "sft.jsonl", [chat(i, None) for i in range(16)])
    cfg = tiny_sft_config(max_steps=3, save_steps=1, save_total_limit=3, keep_checkpoints=True)
    spec = sft_config.SftRun("sft", tiny_model_dir, root / "sft.jsonl", root / "out", root / "pristine",
                           root / "m.json")
    sft_run.train_variant(cfg, LEVELS, spec, track=False, compute=compute_from_params())
    assert sorted(p.name for p in spec.checkpoints.glob("checkpoint-*")) == [f"checkpoint-{n}" for n in (1, 2, 3)]
    return cfg, spec


def _copy(spec, tmp_path) -> sft_config.SftRun:
    ck = tmp_path / "ck"
    shutil.copytree(spec.checkpoints, ck)
    return sft_config.SftRun("sft", spec.model_dir, spec.data, tmp_path / "out", ck, tmp_path / "m.json")


DAMAGE = {  # file damaged -> what damage() says about it
    "adapter_model.safetensors": "incomplete metadata",
    "trainer_state.json": "invalid JSON",
    "optimizer.pt": "empty file",
}


def _damage(folder: Path, name: str) -> None:
    path = folder / name
    if name == "optimizer.pt":
        path.write_bytes(b"")
    else:
        os.truncate(path, path.stat().st_size // 2 if name.endswith(".safetensors") else 28)


@pytest.mark.parametrize("name", list(DAMAGE))
def test_resume_skips_a_damaged_newest_checkpoint_and_names_it(trained, tmp_path, capsys, name):
    cfg, pristine = trained
    spec = _copy(pristine, tmp_path)
    _damage(spec.checkpoints / "checkpoint-3", name)
    assert checkpoints.damage(spec.checkpoints / "checkpoint-2") is None
    summary = sft_run.train_variant(cfg, LEVELS, spec, track=False, compute=compute_from_params())
    assert summary["resumed_from"] == str(spec.checkpoints / "checkpoint-2") and summary["steps"] == 3
    err = capsys.readouterr().err
    line = next(line for line in err.splitlines() if line.startswith("warning: damaged checkpoint"))
    assert f"{spec.checkpoints / 'checkpoint-3' / name}:" in line and DAMAGE[name] in line  # JSON: `file:line: ...`
    assert line.endswith(f"resuming from {spec.checkpoints / 'checkpoint-2'}")
    assert checkpoints.damage(spec.checkpoints / "checkpoint-3") is None  # written again by the resumed run


def test_no_intact_checkpoint_starts_over_and_says_so(trained, tmp_path, capsys):
    _, pristine = trained
    spec = _copy(pristine, tmp_path)
    for n, name in zip((1, 2, 3), DAMAGE):
        _damage(spec.checkpoints / f"checkpoint-{n}", name)
    resume, damaged = checkpoints.newest_intact(spec.checkpoints)
    assert resume is None and [re.sub(r":\d+$", "", d.split(": ")[0]) for d in damaged] == [
        str(spec.checkpoints / f"checkpoint-{n}" / name) for n, name in zip((3, 2, 1), reversed(DAMAGE))]
    checkpoints.report(spec.checkpoints, resume, damaged)
    assert f"no intact checkpoint in {spec.checkpoints}: training starts over" in capsys.readouterr().err


def test_missing_training_state_and_the_mlflow_tags(trained, tmp_path, store):
    import mlflow

    _, pristine = trained
    spec = _copy(pristine, tmp_path)
    (spec.checkpoints / "checkpoint-3" / "scheduler.pt").unlink()
    resume, damaged = checkpoints.newest_intact(spec.checkpoints)
    assert resume.endswith("checkpoint-2") and damaged == [f"{spec.checkpoints}/checkpoint-3/scheduler.pt: missing"]
    with tracking.stage_run("sft", variant="sft") as run:
        checkpoints.report(spec.checkpoints, resume, damaged)
    tags = mlflow.MlflowClient().get_run(run.info.run_id).data.tags
    assert tags[checkpoints.DAMAGED_TAG] == damaged[0] and tags[checkpoints.RESUME_TAG] == "checkpoint-2"


# ------------------------------------------------------------------------------ a full disk in torch's writer

TORCH_FULL = "[enforce fail at inline_container.cc:672] . unexpected pos 12588672 vs 12588560"


def test_torch_writer_disk_full_names_the_folder(tmp_path):
    with pytest.raises(OutputError) as info, runs.disk_errors(tmp_path / "ckpt"):
        raise RuntimeError(TORCH_FULL)
    text = str(info.value)
    assert text.startswith(f"{tmp_path}/ckpt: could not be written (disk full or file too large: [enforce fail")
    assert "free there" in text and "\n" not in text


def test_torch_writer_disk_full_inside_a_stage_publishes_nothing(tmp_path):
    out = tmp_path / "model"
    with pytest.raises(OutputError, match=rf"^{out}: could not be written \(disk full"):
        with tracking.published_run("sft", outputs=(out,), track=False) as (_, staged):
            (staged.dir(out) / "w.bin").write_bytes(b"x")
            raise RuntimeError(f"{TORCH_FULL}: PytorchStreamWriter failed writing file data/0: file write failed")
    assert not out.exists() and not list(tmp_path.iterdir())


def test_a_real_file_size_limit_in_torch_save_is_one_line(tmp_path):
    """torch.save past `ulimit -f` (Python ignores SIGXFSZ, so the write fails) under `disk_errors`."""
    script = textwrap.dedent(f"""\
        import resource, torch
        from rcgrpo_tasks.train.common import runs
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        with runs.disk_errors({str(tmp_path / 'ckpt')!r}):
            torch.save(torch.zeros(1 << 20), {str(tmp_path / 'big.pt')!r})
        """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert res.returncode != 0
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("rcgrpo_tasks.ops.outputs.OutputError: ") and f"{tmp_path}/ckpt: could not be written" in last
    assert "file size limit 1.0 MiB (ulimit -f)" in last


# ------------------------------------------------------------------------------ output budget vs the context


def test_max_new_tokens_beyond_the_model_context_fails_naming_key_and_context(tiny_model_dir):
    key = "params.yaml:evaluate.max_new_tokens"
    with pytest.raises(ConfigError, match=rf"^{key} 131072: .*\(8192 positions, config.json max_position_embeddings\)"
                                          rf".*use at most {8192 - PROMPT_FLOOR}$"):
        _decode(max_new_tokens=131_072).check_context(tiny_model_dir, key)
    _decode(max_new_tokens=8192 - PROMPT_FLOOR).check_context(tiny_model_dir, key)


def _decode(**overrides) -> DecodeConfig:
    """params `evaluate`'s decoding settings with `overrides`."""
    from rcgrpo_tasks.evaluation.accuracy import EvaluateConfig

    return config_from_params(EvaluateConfig, "evaluate", **overrides).decode


def test_the_evaluate_stage_refuses_it_before_loading_the_model(tmp_path, tiny_model_dir):
    from typer.testing import CliRunner

    from rcgrpo_tasks.stages import evaluate as evaluate_stage

    write_params(tmp_path / "params.yaml", {"evaluate": {"max_new_tokens": 131072}})
    split = tmp_path / "split.json"
    split.write_text('{"train": [], "test": []}')
    res = CliRunner().invoke(evaluate_stage.app, ["--model", str(tiny_model_dir), "--out", str(tmp_path / "out"),
                                                  "--split", str(split), "--params", str(tmp_path / "params.yaml")])
    assert res.exit_code == 2 and "evaluate.max_new_tokens 131072" in res.output and "8192 positions" in res.output
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------ a stopped flow's record


def test_a_stop_signal_without_a_message_is_named_in_the_error_tag():
    from prefect.exceptions import TerminationSignal

    assert tracking.describe_error(TerminationSignal(signal=15)) == "TerminationSignal: stopped by SIGTERM"
    assert tracking.describe_error(ValueError("bad\n input")) == "ValueError: bad input"
