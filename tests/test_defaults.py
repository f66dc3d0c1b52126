"""One source of truth for defaults: every key of the pristine params.yaml equals its stage config's default.

A stage's frozen config dataclass (`ops.config.load_config`) fills a key the section leaves out with its
default, and tests and benches build configs from those defaults; the profiles in configs/*.yaml are the
only overlays. So a value changed in params.yaml must be changed in its dataclass too (and back): this test
names every key where the two differ.
"""

from __future__ import annotations

import yaml
from helpers import REPO_ROOT

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
from rcgrpo_tasks.train.rl.config import RLConfig
from rcgrpo_tasks.train.sft.config import SftConfig

SECTIONS = {
    "prepare_data": PrepareDataConfig, "prompt": PromptConfig, "compute": ComputeConfig,
    "prepare_model": PrepareModelConfig, "evaluate": EvaluateConfig, "generate_trajectories": GenerateConfig,
    "validate_trajectories": ValidateConfig, "label_rewards": LabelConfig, "sft": SftConfig,
    "controllability": ControllabilityConfig, "sample_policy": SampleConfig, "rl": RLConfig,
    "promote": PromoteConfig, "grid": GridConfig, "endpoints": EndpointsConfig,
}
"""params.yaml section -> the config dataclass its stage loads it into."""


def _plain(value):
    """Tuples as lists, recursively: params YAML has lists where the dataclasses keep tuples."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _pristine() -> dict:
    text, origin = profiles.pristine_params(REPO_ROOT / "params.yaml")
    params = yaml.safe_load(text)
    assert isinstance(params, dict), f"{origin}: not a mapping"
    return params


def _compare(value, default, key: str, out: dict) -> None:
    """Mappings key by key (`sft.variants.rctp.init`), anything else as a whole."""
    if isinstance(value, dict) and isinstance(default, dict):
        for k in [*value, *(k for k in default if k not in value)]:
            _compare(value.get(k, config.ABSENT), default.get(k, config.ABSENT), f"{key}.{k}", out)
    elif _plain(value) != _plain(default):
        out[key] = (value, default)


def _differences(params: dict) -> dict[str, tuple]:
    """{section.key: (params value, dataclass default)} for every key where the two differ (a key of the
    section's mapping values, e.g. `sft.variants.rctp.init`, on its own)."""
    out: dict[str, tuple] = {}
    for section, cls in SECTIONS.items():
        if section in ("grid", "endpoints"):  # no defaults: params.yaml alone says what runs and what is judged
            continue
        defaults = config.as_dict(cls())
        for key, value in (params.get(section) or {}).items():
            _compare(value, defaults.get(key, config.ABSENT), f"{section}.{key}", out)
    return out


def test_every_section_has_its_config():
    params = _pristine()
    assert set(params) == set(SECTIONS), f"params.yaml sections {sorted(params)} vs mapped {sorted(SECTIONS)}"
    for section, cls in SECTIONS.items():
        unknown = sorted(set(params[section] or {}) - set(config.section_keys(cls)))
        assert not unknown, f"params.yaml {section}: keys {unknown} are not fields of {cls.__name__}"


def test_params_yaml_values_are_the_dataclass_defaults():
    wrong = _differences(_pristine())
    assert not wrong, "params.yaml value != dataclass default (change the dataclass default):\n" + "\n".join(
        f"  {key}: params.yaml {value!r}, {SECTIONS[key.split('.')[0]].__name__} default {default!r}"
        for key, (value, default) in wrong.items())


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
