"""Typed stage configs loaded from `params.yaml`.

Every stage owns one frozen dataclass whose fields mirror its `params.yaml` section (one docstring per
field, cleanrl-style). `load_config(Cls, params_path, section)` reads the section, rejects unknown keys
(a typo must not silently fall back to a default), checks basic types, and lets the dataclass's own
`__post_init__` enforce invariants, so bad params fail before any work starts, naming file and field.
A config class holds types, docstrings and checks, never a tuned value: its fields have no defaults (only
structural ones such as a DeepSpeed path may), so every value lives in the params file alone, a section
that lacks one fails naming it (`required_keys`), and tuning a value changes no code (DVC reruns only the
stages whose params name it).

Profiles (overlays of `params.yaml` sections materialized into it): `ops.profiles`.

Read once, checked at publication: every section (`load_config`, `read_sections`) or key (`load_keys`) a stage
reads is remembered as it was read, and `check_params_unchanged()` (run by `ops.tracking.published_run` before
anything is published) fails when the file now says otherwise. DVC reads the params when it writes
dvc.lock, after the command: results made with the old values would otherwise be recorded, and served
from its run cache, under the new ones.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

from rcgrpo_tasks.ops.outputs import OutputError

T = TypeVar("T")
_USED: dict[Path, dict[str, Any]] = {}  # params file (resolved) -> {section: its value as this process read it}


class ConfigError(ValueError):
    """A params file or section is invalid; the message names the file and the field."""


class ParamsChanged(OutputError):
    """The params file changed while a stage ran: its results no longer match the file (nothing is published).
    An OutputError, so the `rcgrpo` entry point prints one line and exits 2."""


def deep_merge(base: dict, over: dict) -> dict:
    """`base` with `over` merged in key by key: nested mappings merge, anything else in `over` wins (neither is changed)."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def read_params(params_path: str | Path) -> dict:
    """Read a params file (a mapping of stage sections)."""
    path = Path(params_path)
    if not path.is_file():
        raise ConfigError(f"{path}: params file not found")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping")
    return data


class _Absent:
    def __repr__(self) -> str:
        return "absent"


ABSENT = _Absent()
"""How a section or key missing from the file is remembered and shown."""


def read_sections(params_path: str | Path, *sections: str) -> dict:
    """{section: value} of `params_path` for the sections a stage uses (a missing one is left out), remembered
    as read so `check_params_unchanged` can tell whether they changed before the stage publishes."""
    path = Path(params_path)
    data = read_params(path)
    used = _USED.setdefault(path.resolve(), {})
    for section in sections:
        used[section] = copy.deepcopy(data[section]) if section in data else ABSENT
    return {section: data[section] for section in sections if section in data}


def _changed_keys(old: Any, new: Any, prefix: str) -> list[str]:
    """Dotted keys whose values differ between two parsed params values, with both values."""
    if isinstance(old, dict) and isinstance(new, dict):
        return [k for key in sorted(set(old) | set(new), key=str)
                for k in _changed_keys(old.get(key, ABSENT), new.get(key, ABSENT), f"{prefix}.{key}")]
    return [] if old == new else [f"{prefix} ({old!r} -> {new!r})"]


def changed_params() -> list[str]:
    """`file: key (old -> new)` for every params key this process read that its file no longer holds."""
    changed = []
    for path, sections in _USED.items():
        try:
            now = read_params(path)
        except ConfigError as exc:
            changed.append(str(exc))
            continue
        shown = path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path
        for section, value in sections.items():
            here = functools.reduce(lambda d, k: d.get(k, ABSENT) if isinstance(d, dict) else ABSENT,
                                    section.split("."), now)  # a section, or one key of it (`load_keys`)
            changed += [f"{shown}:{key}" for key in _changed_keys(value, here, section)]
    return changed


def check_params_unchanged(what: str = "this stage") -> None:
    """ParamsChanged (one line naming the changed keys) when a params section read by this process has changed
    in its file since: the stage's results were made with the old values, so none may be published."""
    changed = changed_params()
    if changed:
        shown = "; ".join(changed[:8]) + (f"; and {len(changed) - 8} more" if len(changed) > 8 else "")
        raise ParamsChanged(f"params changed while {what} ran: {shown}; nothing was published: rerun it")


def forget_params() -> None:
    """Forget the sections read so far (a test, or a process that runs several stages one after another)."""
    _USED.clear()


def _type_ok(value: Any, hint: Any) -> bool:
    if hint is Any:
        return True
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if origin is typing.Literal:
        return value in typing.get_args(hint)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin in (tuple, list):
        args = typing.get_args(hint)
        if not isinstance(value, (list, tuple)):
            return False
        inner = args[0] if args else Any
        return all(_type_ok(v, inner) for v in value)
    if origin is dict:
        return isinstance(value, dict)
    if isinstance(hint, type):
        return isinstance(value, hint)
    return True


FLAT = "rcgrpo.flat"
"""Field metadata: a nested config written flat in its section (`flat_field`): (its class, the keys the section
sets, the values the stage fixes for the others)."""


def flat_field(cls: type, keys: tuple[str, ...] | None = None, fixed: dict | None = None) -> Any:
    """A required config field holding a nested config of `cls` (e.g. the engine's `DecodeConfig`) whose keys
    are written FLAT in the stage's own params section (`evaluate.max_new_tokens`, not
    `evaluate.decode.max_new_tokens`): one class, one set of docstrings and checks, composed into every stage
    that needs it, while a user still edits `evaluate:`. `keys`: the nested keys this section sets (default:
    all), each required there; `fixed`: the value of every other key, what the stage itself fixes (the
    engine it loads) or fills later from where the value really lives (documented at the stage's field), never
    a tuned value: those are the section's keys."""
    names = tuple(f.name for f in dataclasses.fields(cls))
    keys = names if keys is None else tuple(keys)
    fixed = dict(fixed or {})
    if set(keys) & set(fixed) or set(keys) | set(fixed) != set(names):
        raise TypeError(f"flat_field({cls.__name__}): keys {keys} and fixed {sorted(fixed)} must split its fields "
                        f"{names}")
    return dataclasses.field(metadata={FLAT: (cls, keys, fixed)})


def _flat_fields(cls) -> dict[str, tuple[str, ...]]:
    return {f.name: f.metadata[FLAT][1] for f in dataclasses.fields(cls) if FLAT in f.metadata}


def required_keys(cls) -> list[str]:
    """The keys a params section of `cls` must hold: every field without a default (a flat field's keys)."""
    flat = _flat_fields(cls)
    keys = []
    for f in dataclasses.fields(cls):
        if f.init and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            keys += list(flat[f.name]) if f.name in flat else [f.name]
    return keys


def section_keys(cls) -> list[str]:
    """The keys a params section of `cls` may hold, flat keys included."""
    flat = _flat_fields(cls)
    keys = []
    for f in dataclasses.fields(cls):
        if f.init:
            keys += list(flat[f.name]) if f.name in flat else [f.name]
    return keys


def _check_value(value: Any, hint: Any, where: str) -> Any:
    if not _type_ok(value, hint):
        raise ConfigError(f"{where}: expected {hint}, got {value!r}")
    return tuple(value) if typing.get_origin(hint) is tuple and isinstance(value, list) else value


def from_dict(cls: type[T], data: dict, where: str = "") -> T:
    """Build a frozen config dataclass from a mapping; unknown keys and wrong types raise ConfigError.

    A key the class lists in `MOVED_KEYS` ({old key: its new place}) fails naming where it went. Nested
    configs declared with `flat_field` read their keys from the same mapping and run their own checks."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(data).__name__}")
    moved = getattr(cls, "MOVED_KEYS", {})
    for key in data:
        if key in moved:
            raise ConfigError(f"{where}.{key}: this key moved: {moved[key]}")
    hints = typing.get_type_hints(cls)
    flat = _flat_fields(cls)
    allowed = section_keys(cls)
    unknown = sorted(set(data) - set(allowed))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(allowed)}")
    missing = [k for k in required_keys(cls) if k not in data]
    if missing:
        raise ConfigError(f"{where}: missing key(s) {missing}: every tuned value is written in the params file")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in flat:
            nested, keys, fixed = f.metadata[FLAT]
            kwargs[f.name] = from_dict(nested, {**fixed, **{k: data[k] for k in keys}}, where)
    for key, value in data.items():
        if not any(key in keys for keys in flat.values()):
            kwargs[key] = _check_value(value, hints[key], f"{where}.{key}")
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{where}: {exc}") from exc


def load_config(cls: type[T], params_path: str | Path, section: str) -> T:
    """Load `section` of `params_path` into `cls` (remembered as read: `check_params_unchanged`)."""
    data = read_sections(params_path, section)
    if section not in data:
        raise ConfigError(f"{params_path}: missing section {section!r}")
    return from_dict(cls, data[section] or {}, where=f"{params_path}:{section}")


def load_keys(cls: type[T], params_path: str | Path, section: str) -> T:
    """`cls` from the keys it declares of `section`, its other keys left aside (evaluate samples at `rl.temperature`
    without the RL config class); every key must be there, and is remembered as read on its own."""
    path, keys = Path(params_path), section_keys(cls)
    data = read_params(path).get(section) or {}
    missing = [k for k in keys if k not in data]
    if missing:
        raise ConfigError(f"{path}:{section}: missing key(s) {missing}")
    _USED.setdefault(path.resolve(), {}).update({f"{section}.{k}": copy.deepcopy(data[k]) for k in keys})
    return from_dict(cls, {k: data[k] for k in keys}, where=f"{path}:{section}")


def as_dict(config: Any) -> dict:
    """A config as its params section reads (flat keys flattened back, in field order), for MLflow params and
    run records."""
    flat = _flat_fields(type(config))
    out: dict = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if f.name in flat:
            nested = dataclasses.asdict(value)
            out.update({k: nested[k] for k in flat[f.name]})
        else:
            out[f.name] = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else copy.deepcopy(value)
    return out


def seeded(base_seed: int, grid_seed: int | None) -> int:
    """A seeded run's own seed: its section's seed + the grid seed (None: not a grid run, the section's)."""
    return base_seed + (grid_seed or 0)


def load_with(cls: type[T], params_path: str | Path, section: str, **overrides: Any) -> T:
    """`cls` from `section` of `params_path` with `overrides` (flat keys, as the section writes them): a config for
    code that is no stage (a bench, the GPU kit), built from the params file, never from a second copy of its
    values. Not remembered as read: nothing it makes is published as a stage's output."""
    data = read_params(params_path).get(section) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{params_path}:{section}: expected a mapping, got {type(data).__name__}")
    where = f"{params_path}:{section}" + (f" with {sorted(overrides)} set" if overrides else "")
    return from_dict(cls, {**data, **overrides}, where)
