"""One decoding config composed into every decoding stage: flat params keys, one set of checks, moved keys
named, and every shipped profile loading into every stage config."""

from __future__ import annotations

import pytest
from helpers import REPO_ROOT, config_from_params, params_section

from rcgrpo_tasks.data.dataset import GenerateConfig
from rcgrpo_tasks.data.onpolicy import SampleConfig
from rcgrpo_tasks.engine.decoding import MAX_NEW_TOKENS, DecodeConfig
from rcgrpo_tasks.evaluation.accuracy import EvaluateConfig
from rcgrpo_tasks.evaluation.controllability import ControllabilityConfig
from rcgrpo_tasks.ops import config, profiles
from rcgrpo_tasks.ops.config import ConfigError, as_dict, from_dict
from rcgrpo_tasks.train.rl.config import RLConfig

DECODING = {"evaluate": EvaluateConfig, "sample_policy": SampleConfig, "generate_trajectories": GenerateConfig,
            "controllability": ControllabilityConfig, "rl": RLConfig}


def test_flat_keys_compose_and_read_back():
    cfg = config_from_params(EvaluateConfig, "evaluate", **{"max_new_tokens": 7, "temperature": 0.5, "limit": 3}, where="p:evaluate")
    assert isinstance(cfg.decode, DecodeConfig) and (cfg.decode.max_new_tokens, cfg.decode.temperature) == (7, 0.5)
    assert cfg.decode.max_outputs == params_section("evaluate")["max_outputs"]  # the section's own value
    flat = as_dict(cfg)
    assert "decode" not in flat and flat["max_new_tokens"] == 7 and flat["limit"] == 3
    assert from_dict(EvaluateConfig, flat) == cfg


def test_a_stage_exposes_only_its_own_decode_keys():
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['batch_rows'\]"):  # policy rows decode per group
        config_from_params(GenerateConfig, "generate_trajectories", **{"batch_rows": 4}, where="p:generate_trajectories")
    assert "batch_rows" not in as_dict(config_from_params(RLConfig, "rl")) and "temperature" in as_dict(config_from_params(RLConfig, "rl"))


@pytest.mark.parametrize(("cls", "key", "where"), [
    (GenerateConfig, "policy_dtype", "generate_trajectories.dtype"),
    (GenerateConfig, "policy_backend", "generate_trajectories.backend"),
    (ControllabilityConfig, "top_p", "rl.top_p"),
])
def test_an_old_key_names_its_new_place(cls, key, where):
    with pytest.raises(ConfigError, match=rf"p:s\.{key}: this key moved: {where}"):
        from_dict(cls, {key: "float32"}, "p:s")


@pytest.mark.parametrize(("section", "key", "value"), [
    ("evaluate", "max_new_tokens", 100_000_000), ("evaluate", "n_bootstrap", 1_000_000_000),
    ("sample_policy", "batch_rows", 0), ("rl", "max_outputs", 10**6), ("controllability", "n_bootstrap", 5),
    ("evaluate", "temperature", -1.0), ("sample_policy", "temperature", 0.0),
])
def test_absurd_values_fail_before_any_work_naming_the_field(section, key, value):
    with pytest.raises(ConfigError, match=key if key != "max_new_tokens" else str(MAX_NEW_TOKENS)):
        config_from_params(DECODING[section], section, **{key: value})


@pytest.mark.parametrize("profile", profiles.profile_names(REPO_ROOT, set(config.read_params(REPO_ROOT / "params.yaml"))))
def test_every_profile_loads_into_every_decoding_stage(profile, tmp_path):
    """A profile that still uses a moved or misspelt key fails here, not minutes into a run."""
    out = tmp_path / "params.yaml"
    overlay = profile if profile == profiles.DEFAULT_PROFILE else str(REPO_ROOT / "configs" / f"{profile}.yaml")
    merged = profiles.apply_profile(REPO_ROOT / "params.yaml", overlay, out)
    for section, cls in DECODING.items():
        from_dict(cls, merged[section], f"{profile}:{section}")
