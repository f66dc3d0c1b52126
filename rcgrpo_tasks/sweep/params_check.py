"""The whole params file checked at once: every section built into its stage's frozen config (each class's own
checks), then the rules that span sections. Run by the pipeline's root stage (`rcgrpo check-params`, which
every other stage follows in dvc.yaml), by `rcgrpo plan`, by `rcgrpo params --profile` on what it is about to
write, and by the Prefect flow before its MLflow parent run opens, so a bad value anywhere fails in about a
second instead of when the stage that reads it starts (the report, after every other stage).

Checking a section here makes no stage depend on it: DVC's lineage stays each stage's own `params:` list.

Here because it reads every stage's config class: the top library layer (above evaluation and training),
beside the dev sweep, whose candidates are params files too. Each rule is defined once, by the class or
function cited; this module only adds the rules no single stage can see (`cross_section`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from rcgrpo_tasks.data.dataset import GenerateConfig, check_task
from rcgrpo_tasks.data.labels import LabelConfig
from rcgrpo_tasks.data.onpolicy import SampleConfig
from rcgrpo_tasks.data.quality import ValidateConfig
from rcgrpo_tasks.engine.compute import ComputeConfig
from rcgrpo_tasks.engine.source import PrepareModelConfig
from rcgrpo_tasks.env.prompt import PromptConfig
from rcgrpo_tasks.env.split import PrepareDataConfig
from rcgrpo_tasks.env.tasks import get_task
from rcgrpo_tasks.evaluation.accuracy import EvaluateConfig
from rcgrpo_tasks.evaluation.controllability import ControllabilityConfig
from rcgrpo_tasks.evaluation.endpoints import PREMISE, SINGLE, EndpointsConfig
from rcgrpo_tasks.evaluation.grid import GridConfig
from rcgrpo_tasks.evaluation.promotion import PromoteConfig
from rcgrpo_tasks.ops.config import ConfigError, from_dict, read_params
from rcgrpo_tasks.ops.resources import ResourcesConfig, dvc_groups
from rcgrpo_tasks.train.rl.config import RLConfig, check_reward, check_world
from rcgrpo_tasks.train.sft.config import SftConfig

SECTIONS: dict[str, type] = {
    "prepare_data": PrepareDataConfig, "prompt": PromptConfig, "compute": ComputeConfig, "grid": GridConfig,
    "endpoints": EndpointsConfig, "prepare_model": PrepareModelConfig, "evaluate": EvaluateConfig,
    "generate_trajectories": GenerateConfig, "validate_trajectories": ValidateConfig, "label_rewards": LabelConfig,
    "sft": SftConfig, "controllability": ControllabilityConfig, "sample_policy": SampleConfig, "rl": RLConfig,
    "promote": PromoteConfig, "resources": ResourcesConfig,
}
"""Every section of a params file and the config class its stage loads it into."""
SFT_VARIANTS = ("sft", "rctp")
"""The `sft.variants` dvc.yaml trains (`rcgrpo sft --variant`), each resolved as its stage resolves it."""
RL_MEASURES = ("zero_variance", *SINGLE, *PREMISE)
"""Endpoint measures read from RL runs (or, `PREMISE`, from the check of an RCTP-init cell's policy after RL):
their cells must be RL cells of the grid."""


def _section(name: str, data: Any, where: str) -> Any:
    config = from_dict(SECTIONS[name], data if data is not None else {}, where=f"{where}:{name}")
    if name == "sft":
        for variant in SFT_VARIANTS:
            try:
                config.resolve(variant)
            except ConfigError as exc:  # its own message names `sft.variants.<variant>...`; add the file
                raise ConfigError(f"{where}:{exc}") from exc
    return config


def check_params(params: Any, where: str) -> dict[str, Any]:
    """{section: its config} of a parsed params file; ConfigError listing every problem, one line each, named
    `<where>:<section>: <field>: <what is allowed>` (`where`: the file, or how it was made). Sections are
    checked one by one (every bad section is reported), then the cross-section rules on the valid ones."""
    if not isinstance(params, dict):
        raise ConfigError(f"{where}: top level must be a mapping of sections, got {type(params).__name__}")
    problems = [f"{where}: unknown section {name!r}; sections: {sorted(SECTIONS)}"
                for name in sorted(set(params) - set(SECTIONS), key=str)]
    problems += [f"{where}: missing section {name!r}: every tuned value is written in the params file"
                 for name in SECTIONS if name not in params]
    configs: dict[str, Any] = {}
    for name in SECTIONS:
        if name in params:
            try:
                configs[name] = _section(name, params[name], where)
            except ConfigError as exc:
                problems.append(str(exc))
    for section, rule in CROSS_SECTION:
        needs = list(inspect.signature(rule).parameters)
        if all(n in configs for n in needs):  # a rule over a section that failed on its own says nothing new
            try:
                rule(*(configs[n] for n in needs))
            except (ConfigError, ValueError) as exc:  # each rule's message starts with its section's name
                message = str(exc)
                problems.append(f"{where}:{message}" if message.startswith(section) else f"{where}:{section}: {message}")
    if problems:
        raise ConfigError("\n".join(problems))
    return configs


def check_file(path: str | Path) -> dict[str, Any]:
    """`check_params` of the params file at `path` (read errors name the file too); where a dvc.yaml lies beside
    it, every stage `resources` names must be one of its stages (a typo would run that stage on `cpu`)."""
    configs = check_params(read_params(path), str(path))
    groups = dvc_groups(Path(path).parent)
    unknown = configs["resources"].unknown(groups) if groups is not None else []
    if unknown:
        raise ConfigError(f"{path}:resources: stages: {unknown} name no stage of {Path(path).parent / 'dvc.yaml'}; "
                          f"its stages: {sorted(groups)}")
    return configs


# -- the rules that span sections ------------------------------------------------------------------------

def endpoint_models(grid: GridConfig, endpoints: EndpointsConfig, evaluate: EvaluateConfig,
                    rl: RLConfig) -> None:
    """Every endpoint names models the grid runs, with the measure it needs: RL measures (`RL_MEASURES`) RL
    cells (`grid.cells`) whose runs record it (the probe needs `rl.probe_entries` > 0, its transfer half
    `rl.probe_transfer_entries` > 0 too); pass@1 and greedy the evaluated models (`grid.labels`,
    `grid.seeded_labels`), pass@1 only where evaluate samples it (`evaluate.pass_samples` > 0, and not a
    `grid.evaluate` entry run with `--no-pass1`). What the report would otherwise refuse after every stage."""
    evaluated = [*grid.labels, *grid.seeded_labels]
    no_pass1 = [label for label, item in grid.evaluate.items() if "--no-pass1" in str(item["flags"]).split()]
    for rank, index, e in ((r, i, e) for r in ("primary", "secondary") for i, e in enumerate(getattr(endpoints, r))):
        m = e["measure"]
        for key in ("cell", "versus"):
            if key not in e:
                continue
            who, field = e[key], f"{rank}[{index}].{key}"
            if m in RL_MEASURES and who not in grid.cells:
                raise ConfigError(f"endpoints: {field}: {who!r} is not an RL cell of params grid; {m} is measured "
                                  f"on RL cells: {grid.cells}")
            if m in PREMISE and not who.startswith("rctp-"):
                raise ConfigError(f"endpoints: {field}: {m} is read from the premise check after RL, which runs on "
                                  f"the RCTP-init cells only (controllability_rl_rctp); got {who!r}")
            if m not in RL_MEASURES and who not in evaluated:
                raise ConfigError(f"endpoints: {field}: {who!r} is not a model of params grid; {m} is measured on "
                                  f"the evaluated models: {evaluated}")
            if m == "pass1" and (not evaluate.pass_samples or who in no_pass1):
                why = "evaluate.pass_samples is 0" if not evaluate.pass_samples else \
                    f"grid.evaluate.{who} runs with --no-pass1"
                raise ConfigError(f"endpoints: {field}: pass1 of {who!r} is not measured ({why}); use greedy, or "
                                  "sample pass@1 there")
        if m == "probe" and not rl.probe_entries or m == "transfer" and not (rl.probe_entries and
                                                                           rl.probe_transfer_entries):
            raise ConfigError(f"endpoints: {rank}[{index}].measure: {m} needs the fixed probe (rl.probe_entries > 0"
                              + (", rl.probe_transfer_entries > 0" if m == "transfer" else "") + ")")


def generate_reward(prepare_data: PrepareDataConfig, generate_trajectories: GenerateConfig,
                    prompt: PromptConfig) -> None:
    """`generate_trajectories.reward` and `failure_mix` fit the task (`data.dataset.check_task`)."""
    check_task(generate_trajectories, prompt, get_task(prepare_data.task))


def rl_reward(prepare_data: PrepareDataConfig, rl: RLConfig, prompt: PromptConfig) -> None:
    """`rl.reward` is defined for the task under `prompt.protocol` (`train.rl.config.check_reward`; it takes
    entries and reads only their task, so a stand-in carries the task `prepare_data.task` names)."""
    check_reward(rl, prompt.protocol_config(rl.decode.max_outputs), [SimpleNamespace(task=prepare_data.task)])


def rl_processes(rl: RLConfig, compute: ComputeConfig) -> None:
    """`rl.batch_size` splits into `compute.processes` of whole groups (`train.rl.config.check_world`)."""
    check_world(rl, compute.processes)


CROSS_SECTION: tuple[tuple[str, Callable[..., None]], ...] = (
    ("endpoints", endpoint_models), ("generate_trajectories", generate_reward), ("rl", rl_reward),
    ("rl", rl_processes))
"""(the section a problem is reported under, the rule); a rule's arguments are named after the sections it reads."""
