"""One source of truth for tuned values: params.yaml. A stage's frozen config dataclass holds types, one
docstring per field and checks, never a tuned value: its fields have no defaults (structural ones aside:
`STRUCTURAL`), so a section that lacks a key fails naming it, tests and benches build configs from the
committed params.yaml (`helpers.config_from_params`), and the profiles in configs/*.yaml are the only
overlays. Tuning a value is a params change, never a code change.
"""

from __future__ import annotations

import dataclasses

import pytest
import yaml
from helpers import REPO_ROOT, params_section

from rcgrpo_tasks.data.dataset import GenerateConfig
from rcgrpo_tasks.data.labels import LabelConfig
from rcgrpo_tasks.data.onpolicy import SampleConfig
from rcgrpo_tasks.data.quality import ValidateConfig
from rcgrpo_tasks.engine.compute import ComputeConfig
from rcgrpo_tasks.engine.source import PrepareModelConfig
from rcgrpo_tasks.env.prompt import PromptConfig
from rcgrpo_tasks.env.split import PrepareDataConfig
from rcgrpo_tasks.evaluation.accuracy import EvaluateConfig
from rcgrpo_tasks.evaluation.controllability import ControllabilityConfig
from rcgrpo_tasks.evaluation.endpoints import EndpointsConfig
from rcgrpo_tasks.evaluation.grid import GridConfig
from rcgrpo_tasks.evaluation.promotion import PromoteConfig
from rcgrpo_tasks.ops import config, profiles
from rcgrpo_tasks.ops.config import ConfigError
from rcgrpo_tasks.ops.resources import ResourcesConfig
from rcgrpo_tasks.train.rl.config import GuardConfig, RLConfig
from rcgrpo_tasks.train.sft.config import SftConfig

SECTIONS = {
    "prepare_data": PrepareDataConfig, "prompt": PromptConfig, "compute": ComputeConfig,
    "prepare_model": PrepareModelConfig, "evaluate": EvaluateConfig, "generate_trajectories": GenerateConfig,
    "validate_trajectories": ValidateConfig, "label_rewards": LabelConfig, "sft": SftConfig,
    "controllability": ControllabilityConfig, "sample_policy": SampleConfig, "rl": RLConfig,
    "promote": PromoteConfig, "grid": GridConfig, "endpoints": EndpointsConfig, "resources": ResourcesConfig,
}
"""params.yaml section -> the config dataclass its stage loads it into."""
STRUCTURAL = {
    "compute": {"accelerate_config"},  # a file path; null = plain DDP
    "sft": {"deepspeed", "variants"},  # a file path; the runs of one definition (none: no variant)
    "rl": {"deepspeed", "extra"},  # a file path; GRPOConfig's escape hatch
    "promote": {"metric_key"},  # unused since the paired gate: kept so params files carrying it load
}
"""The only fields that may have a code default: structure (paths, escape hatches), never a tuned value."""


def _pristine() -> dict:
    text, origin = profiles.pristine_params(REPO_ROOT / "params.yaml")
    params = yaml.safe_load(text)
    assert isinstance(params, dict), f"{origin}: not a mapping"
    return params


def test_every_section_maps_to_its_config_and_loads(tmp_path):
    params = _pristine()
    assert set(params) == set(SECTIONS), f"params.yaml sections {sorted(params)} vs mapped {sorted(SECTIONS)}"
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    for section, cls in SECTIONS.items():
        assert isinstance(config.load_config(cls, path, section), cls)


def test_every_field_is_written_in_params_yaml():
    """No implicit default: every key a section may hold is there, optional and structural ones included."""
    params = _pristine()
    absent = {s: [k for k in config.section_keys(cls) if k not in (params[s] or {})] for s, cls in SECTIONS.items()}
    assert not any(absent.values()), f"keys left to a code default (write them in params.yaml): {absent}"


@pytest.mark.parametrize("cls", [*SECTIONS.values(), GuardConfig], ids=lambda c: c.__name__)
def test_no_tuned_value_has_a_code_default(cls):
    section = next((s for s, c in SECTIONS.items() if c is cls), None)
    defaulted = {f.name for f in dataclasses.fields(cls)
                 if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING}
    assert defaulted <= STRUCTURAL.get(section, set()), f"{cls.__name__}: code defaults {sorted(defaulted)}"


@pytest.mark.parametrize("section", [s for s in SECTIONS if s not in ("grid", "endpoints")])
def test_a_missing_key_fails_naming_file_section_and_key(section):
    cls, full = SECTIONS[section], params_section(section)
    for key in config.required_keys(cls):
        data = {k: v for k, v in full.items() if k != key}
        with pytest.raises(ConfigError, match=rf"^p\.yaml:{section}: missing key\(s\) \['{key}'\]"):
            config.from_dict(cls, data, f"p.yaml:{section}")


def test_load_config_names_every_missing_key(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump({"rl": {k: v for k, v in params_section("rl").items()
                                           if k not in ("learning_rate", "temperature")}}))
    with pytest.raises(ConfigError, match=rf"^{path}:rl: missing key\(s\) \['learning_rate', 'temperature'\]"):
        config.load_config(RLConfig, path, "rl")


LAYERINGS = ("gpu+lease", "gpu+smoke+dryrun", "gpu+lease+smoke+dryrun", "multi-turn+smoke", "cpu-long")
"""The layered profiles the docs tell users to write (docs/gpu-run.md, README): each must load."""


def test_every_profile_and_documented_layering_loads_into_every_stage_config():
    """A profile (or a layering) with a key its stage does not know, a wrong type or an inconsistent value
    fails at load (`from_dict` and the configs' own checks), and each SFT variant resolves: found here, not
    minutes into a run (or a lease) when that stage starts."""
    from rcgrpo_tasks.data.dataset import check_task
    from rcgrpo_tasks.env.tasks import get_task
    from rcgrpo_tasks.ops.config import deep_merge

    base = _pristine()
    names = [n for n in profiles.profile_names(REPO_ROOT, set(base)) if n != profiles.DEFAULT_PROFILE]
    for profile in [*names, *LAYERINGS]:
        merged = base
        for layer in profiles.profile_layers(profile):
            merged = deep_merge(merged, yaml.safe_load((REPO_ROOT / "configs" / f"{layer}.yaml").read_text()))
        for section, cls in SECTIONS.items():
            cfg = config.from_dict(cls, merged[section], f"{profile}:{section}")
            if cls is SftConfig:
                for variant in merged[section].get("variants", {}):
                    cfg.resolve(variant)
        loaded = {s: config.from_dict(SECTIONS[s], merged[s]) for s in ("generate_trajectories", "prompt", "prepare_data")}
        check_task(loaded["generate_trajectories"], loaded["prompt"], get_task(loaded["prepare_data"].task))


def test_the_lease_profile_is_the_single_turn_task_on_the_gpu_profiles_device():
    """`gpu+lease` runs the task the embedded model succeeds on, with none of the multi-turn failure kinds
    that `gpu` adds, on every held-out entry, and RL at more steps and groups than the CPU default."""
    from rcgrpo_tasks.ops.config import deep_merge

    base = _pristine()
    merged = base
    for layer in ("gpu", "lease"):
        merged = deep_merge(merged, yaml.safe_load((REPO_ROOT / "configs" / f"{layer}.yaml").read_text()))
    assert merged["prepare_data"]["task"] == "single_turn" and merged["compute"]["device"] == "auto"
    assert merged["evaluate"]["limit"] is None and merged["controllability"]["margin_entries"] is None
    mix = merged["generate_trajectories"]["failure_mix"]
    assert mix["stop_early"] == mix["wrong_turn"] == 0.0
    rl, cpu = merged["rl"], base["rl"]
    assert rl["max_steps"] > cpu["max_steps"] and rl["batch_size"] // rl["num_generations"] > cpu["batch_size"] // cpu["num_generations"]
    assert rl["probe_entries"] * rl["probe_samples"] > cpu["probe_entries"] * cpu["probe_samples"]
