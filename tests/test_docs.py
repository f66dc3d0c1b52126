"""The docs name what exists: every path, stage, module and profile that README.md and docs/*.md write in
backticks is checked against the repository and the pipeline as DVC resolves it. docs/log.md is history
(what held on its day) and is not checked. Placeholders (`<seed>`, `<cell>`, ...) match any one path
component or name part; pipeline outputs (data/, models/, results/, metrics/, checkpoints/, plots/) that are
not committed must be a path some stage writes or reads."""

from __future__ import annotations

import fnmatch
import re
from functools import cache
from pathlib import Path

import pytest
import yaml

from rcgrpo_tasks.ops.pipeline import dvc_stages

REPO_ROOT = Path(__file__).resolve().parents[1]
DOCS = [REPO_ROOT / "README.md", *sorted(p for p in (REPO_ROOT / "docs").glob("*.md") if p.name != "log.md")]
OUTPUT_ROOTS = ("data/", "models/", "results/", "metrics/", "checkpoints/", "plots/", "logs/")
PACKAGES = ("cli", "data", "engine", "env", "evaluation", "ops", "stages", "sweep", "train")
GONE = ("docs/measured.md", "RCGRPO_CPU_BF16")
"""Names that no longer exist and that no doc may use."""
MADE_OUTSIDE_DVC = ("results/study", "results/dev-sweep", "logs/")
"""Outputs of make targets and dev sweeps, not of dvc.yaml's stages."""
ELSEWHERE = ("run/", "retrain/", "eval/", "<", "rc/")
"""Paths on a lent GPU host (`run/`), in a generated retrain project, or relative to a stage's argument; and
the trainer's metric names (`rc/...`), which look like paths."""
OLD_BASES = ("sft", "rl")
"""Stage bases of names that are gone (`sft@rctp`, `rl@<cell>`): still checked, so they fail."""

SPAN = re.compile(r"`([^`\n]+)`")
PLACEHOLDER = re.compile(r"<[^<>/]*>")
STAGE = re.compile(r"^[a-z_]+@[\w<>.\-]+$")
DOTTED = re.compile(r"^(?:rcgrpo_tasks\.)?([a-z_]+)((?:\.[A-Za-z_]\w*)+)$")


def spans(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every backticked span; a span may run over a line break inside a paragraph (joined by
    one space), never out of a code block."""
    out, para, fence = [], [], False

    def flush():
        text = " ".join(line.strip() for _, line in para)
        starts = [n for n, line in para for _ in range(len(line.strip()) + 1)]
        out.extend((starts[m.start()], m.group(1).strip()) for m in re.finditer(r"`([^`]+)`", text))
        para.clear()

    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            flush()
            fence = not fence
        elif fence or not line.strip() or line.lstrip().startswith("|"):
            flush()
            if line.lstrip().startswith("|"):
                out += [(n, t.strip()) for t in SPAN.findall(line)]
        else:
            para.append((n, line))
    flush()
    return out


def expand(text: str) -> list[str]:
    """`a/{b,c}` -> a/b, a/c (one level of braces)."""
    m = re.search(r"\{([^{}]+)\}", text)
    return [text[:m.start()] + part + text[m.end():] for part in m.group(1).split(",")] if m else [text]


@cache
def stages() -> tuple[list[str], list[str]]:
    """Stage names (the default's, and the cells and labels the profiles' `grid` adds) and every path a stage
    reads, writes or passes on its command line."""
    planned = dvc_stages(REPO_ROOT, with_status=False)
    names, paths = [s.name for s in planned], set()
    for s in planned:
        paths.update(s.outs, s.records)
        for cmd in s.cmds:
            paths.update(w.strip('"') for w in cmd.split() if "/" in w and not w.startswith("-"))
    for profile in (REPO_ROOT / "configs").glob("*.yaml"):
        grid = (yaml.safe_load(profile.read_text()) or {}).get("grid") or {}
        names += [f"evaluate@{label}" for label in grid.get("evaluate") or {}]
        for init, algos in (grid.get("rl") or {}).items():
            names += [f"{stage}_{init}@*-{algo}" for algo in algos for stage in ("rl", "evaluate_rl")]
    return names, sorted(paths)


def component_match(pattern: str, path: str) -> bool:
    """Whether `pattern` (placeholders as `*`) names `path`, a folder above it or a file below it."""
    pc, kc = pattern.strip("/").split("/"), path.strip("/").split("/")
    return all(fnmatch.fnmatchcase(k, p) for p, k in zip(pc, kc))


@cache
def deployments() -> frozenset[str]:
    """`<flow>/<deployment>` of every deployment in prefect.yaml (the flow's name from its `@flow(name=...)`)."""
    found = set()
    for d in yaml.safe_load((REPO_ROOT / "prefect.yaml").read_text())["deployments"]:
        path, func = d["entrypoint"].split(":")
        source = (REPO_ROOT / path).read_text()
        flow = re.search(rf'@flow\(name="([^"]+)"[^)]*\)\s*\ndef {func}\(', source)
        found.add(f"{flow.group(1) if flow else func}/{d['name']}")
    return frozenset(found)


def path_ok(text: str) -> bool:
    if text in deployments():
        return True  # a deployment (`rcgrpo/full`, `stage/cpu`), which reads as a path
    pattern = PLACEHOLDER.sub("*", text.split(":")[0].rstrip("/"))
    for root in (REPO_ROOT, REPO_ROOT / "rcgrpo_tasks"):
        if (root / pattern).exists() or "*" in pattern and next(root.glob(pattern), None):
            return True
    if pattern.startswith(OUTPUT_ROOTS):
        if pattern.startswith(MADE_OUTSIDE_DVC):
            return True
        return any(component_match(pattern, k) for k in stages()[1])
    return False


def module_ok(package: str, rest: str) -> bool:
    """`rcgrpo_tasks.a.b.name` (or the library's `rcgrpo.a.name`): a module or package a.b (the longest that
    exists) defining every name after it."""
    root = REPO_ROOT if package in ("rcgrpo", "rcgrpo_tasks") else REPO_ROOT / "rcgrpo_tasks"
    parts = [package, *(p for p in rest.strip(".").split(".") if p)]
    for i in range(len(parts), 0, -1):
        base = root / Path(*parts[:i])
        source = base.with_suffix(".py") if base.with_suffix(".py").exists() else base / "__init__.py"
        if source.exists():
            text = source.read_text()
            return all(re.search(rf"(def|class)\s+{re.escape(n)}\b|^\s*{re.escape(n)}\s*[:=]", text, re.M)
                       or re.search(rf"\b{re.escape(n)}\b", text) for n in parts[i:])
    return False


def library_name(name: str) -> bool:
    """A module of the library (`rcgrpo/<name>.py`) or a name it exports (`rcgrpo.__all__`)."""
    import rcgrpo

    return (REPO_ROOT / "rcgrpo" / f"{name}.py").exists() or name in rcgrpo.__all__ or not name.islower()


def rel(doc: Path) -> str:
    return str(doc.relative_to(REPO_ROOT)) if doc.is_relative_to(REPO_ROOT) else doc.name


def problems(docs: list[Path] = DOCS) -> list[str]:
    names, _ = stages()
    found = []
    for doc, line, span in ((d, n, s) for d in docs for n, s in spans(d)):
        where = f"{rel(doc)}:{line}: `{span}`"
        for text in expand(span):
            if " " in text or text.startswith(("http", "-", "~", "$", ".")):
                continue
            if STAGE.match(text):
                if text.split("@")[0] not in {n.split("@")[0] for n in names} | set(OLD_BASES):
                    continue  # an MLflow parent run (`pipeline@<profile>`), not a stage
                pat = PLACEHOLDER.sub("*", text)
                if not any(fnmatch.fnmatchcase(n, pat) for n in names):
                    found.append(f"{where}: no stage {text!r} in `dvc stage list`")
            elif "/" in text.strip("/") and not re.search(r"^[^/]*[A-Z.]", text) and not text.startswith(
                    ELSEWHERE) and re.match(r"^[\w.<>*{}\-]+(/[\w.<>*{}\-@]*)+(:\S*)?$", text):
                if not path_ok(text):
                    found.append(f"{where}: no path {text!r}")
            elif m := DOTTED.match(text):
                if m.group(1) == "rcgrpo" and m.group(2).count(".") == 1 and not library_name(m.group(2)[1:]):
                    continue  # `rcgrpo.cell`: an MLflow tag, not a name of the library
                if (text.startswith("rcgrpo_tasks.") or m.group(1) in (*PACKAGES, "rcgrpo")) and not module_ok(m.group(1),
                                                                                                  m.group(2)):
                    found.append(f"{where}: no module or name {text!r}")
    for doc in docs:
        body = doc.read_text()
        found += [f"{rel(doc)}: names {g!r}, which is gone" for g in GONE if g in body]
        for profile in re.findall(r"--profile ([\w+.\-/]+)", body):
            for p in profile.split("+"):
                if p != "default" and not p.endswith(".yaml") and p.islower() and not (REPO_ROOT / "configs" / f"{p}.yaml").exists():
                    found.append(f"{rel(doc)}: no profile configs/{p}.yaml")
    return found


def test_docs_name_what_exists():
    assert problems() == []


@pytest.mark.parametrize("plant", ["`rcgrpo_tasks/train/rl/nothing.py`", "`sft@rctp`", "`rl@rctp-rc_grpo`",
                                   "`plots/rl_<run>.tsv`", "`rcgrpo_tasks.engine.no_such_module`",
                                   "`configs/no-such.yaml`", "`evaluate_rl_rctp@<seed>-nothing`",
                                   "`rcgrpo params --profile nothing`", "`RCGRPO_CPU_BF16=0`"])
def test_a_planted_false_name_is_found(plant, tmp_path):
    doc = tmp_path / "planted.md"
    doc.write_text(f"A claim: {plant}, beside true ones: `rl_rctp@<seed>-rc_grpo`, `docs/rl.md`.\n")
    assert len(problems([doc])) == 1, plant


# ------------------------------------------------------------------------------------- values and signatures

KV = re.compile(r"^([a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)*):\s+(\S.*)$")
OPTIONS = {
    "protocol: official", "official_full: true", "vllm_mode: server", "loss_on: divergent", "minibatches: 4",
    'compute.cpu_bf16: "auto"', "compute.processes: 2", "compute: {device: cpu, processes: 2}", "lora_r: 0",
    "source: policy",
}
"""Backticked `key: value` spans that name a value as an option, an example or bad input (or a trajectory
field that shares a params key's name), not as what a profile sets: each is a value params accept or the
doc says it fails."""


def _leaves(data, path=()):
    if isinstance(data, dict):
        for k, v in data.items():
            yield from _leaves(v, (*path, str(k)))
    else:
        yield path, data


@cache
def resolved() -> tuple[list, ...]:
    """Every leaf (path, value) of the pristine params and of every profile as it is run
    (`sweep.profiles.PROFILES`), each fine-tune variant as it trains."""
    from rcgrpo_tasks.ops.profiles import resolve_profile
    from rcgrpo_tasks.stages.params import effective
    from rcgrpo_tasks.sweep.profiles import PROFILES

    return tuple(list(_leaves(effective(resolve_profile(p, REPO_ROOT).merged, p))) for p in PROFILES)


def claims(span: str) -> list[tuple[str, object]]:
    """(dotted key, value) of a backticked `key: value` (several joined by `, `; a flow mapping is one claim
    per key); none for an alternative (`a | b`) or a placeholder (`<x>`, `N`, `k`)."""
    out = []
    for part in [span] if "{" in span else re.split(r",\s+(?=[a-z_][\w.]*:\s)", span):
        m = KV.match(part.strip())
        if not m or re.search(r"[|<>]", m.group(2)) or re.fullmatch(r"[A-Za-z]", m.group(2).split()[0]):
            continue
        try:
            value = yaml.safe_load(m.group(2))
        except yaml.YAMLError:
            continue
        items = value.items() if isinstance(value, dict) else [("", value)]
        out += [(f"{m.group(1)}.{k}" if k else m.group(1), v) for k, v in items]
    return out


def value_ok(key: str, value) -> bool | None:
    """True where some resolved profile holds `value` at a params path ending in `key`, False where such a
    path exists and none holds it, None where `key` names no params key (not a params claim)."""
    parts, found = tuple(key.split(".")), False
    for leaves in resolved():
        for path, v in leaves:
            if path[-len(parts):] == parts:
                found = True
                if v == value:
                    return True
    return False if found else None


CALL = re.compile(r"^((?:[A-Za-z_]\w*\.)*)([A-Za-z_]\w*)\((.*)\)(?:\s*->.*)?$")


@cache
def definitions() -> dict[str, list[tuple[str, str]]]:
    """name -> [(module, qualified name)] of every top-level function and class of the package and every
    method of its classes (by `Class.method`)."""
    import ast

    out: dict[str, list[tuple[str, str]]] = {}
    for path in [*(REPO_ROOT / "rcgrpo_tasks").rglob("*.py"), *(REPO_ROOT / "rcgrpo").rglob("*.py")]:
        module = ".".join(path.relative_to(REPO_ROOT).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                out.setdefault(node.name, []).append((module, node.name))
            if isinstance(node, ast.ClassDef):
                for sub in node.body:
                    if isinstance(sub, ast.FunctionDef):
                        out.setdefault(sub.name, []).append((module, f"{node.name}.{sub.name}"))
    return out


def _args(text: str) -> list[str]:
    """Top-level comma-separated arguments (brackets and quotes kept whole)."""
    out, depth, quote, cur = [], 0, None, ""
    for ch in text:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
            continue
        cur += ch
    return [a for a in [*out, cur.strip()] if a]


def signature_problem(span: str) -> str | None:
    """Why a backticked call `a.b.name(args)` does not fit the package's `name` (None where it fits or names
    nothing of the package): every keyword is a parameter, no more positional arguments than it takes,
    every required parameter given unless `...` stands for the rest, and `kw=a|b` within a Literal's values."""
    import importlib
    import inspect
    import typing

    m = CALL.match(span)
    if not m or re.search(r"\)\s*\.", span):  # a chain (`a().b()`): not one call
        return None
    prefix, name, args = m.group(1).rstrip("."), m.group(2), _args(m.group(3))
    found = definitions().get(name, [])
    if prefix:
        found = [(mod, q) for mod, q in found if f"{mod}.{q}".endswith(f"{prefix}.{name}")
                 or (f"{mod}.{q}").endswith(f"{prefix.split('.')[-1]}.{q}")
                 or (prefix == "rcgrpo" and mod.startswith("rcgrpo."))]  # the library's top-level names
        if not found:
            return None if prefix.split(".")[0] not in (*PACKAGES, "rcgrpo_tasks", "rcgrpo") \
                and not definitions().get(prefix.split(".")[-1]) else f"no {prefix}.{name} in the package"
    if not found:
        return None
    why = []
    for mod, qual in found:
        obj = importlib.import_module(mod)
        for part in qual.split("."):
            obj = getattr(obj, part)
        sig = inspect.signature(obj)
        params = list(sig.parameters.values())
        if "." in qual and inspect.isfunction(obj) and params and params[0].name in ("self", "cls"):
            params = params[1:]
        by_name = {p.name: p for p in params}
        var_kw = any(p.kind is p.VAR_KEYWORD for p in params)
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        given_pos = [a for a in args if not re.match(r"^\w+=", a) and a not in ("...", "…") and not a.startswith("*")]
        kws = dict(a.split("=", 1) for a in args if re.match(r"^\w+=", a))
        bad = [k for k in kws if k not in by_name and not var_kw]
        if len(given_pos) > len(positional) and not any(p.kind is p.VAR_POSITIONAL for p in params):
            bad.append(f"{len(given_pos)} positional arguments, it takes {len(positional)}")
        if "..." not in args and "…" not in args:
            named = {p.name for p in positional[:len(given_pos)]} | set(kws)
            bad += [f"missing {p.name}" for p in params if p.default is p.empty
                    and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name not in named]
        hints = typing.get_type_hints(obj) if not inspect.isclass(obj) else {}
        for k, v in kws.items():
            allowed = typing.get_args(hints.get(k)) if typing.get_origin(hints.get(k)) is typing.Literal else ()
            if allowed and "|" in v and not {x.strip().strip("\"'") for x in v.split("|")} <= set(allowed):
                bad.append(f"{k} takes {list(allowed)}")
        if not bad:
            return None
        why.append(f"{mod}.{qual}{sig}: {'; '.join(bad)}")
    return " / ".join(why)


def value_problems(docs: list[Path] = DOCS) -> list[str]:
    found = []
    for doc, line, span in ((d, n, s) for d in docs for n, s in spans(d)):
        where = f"{rel(doc)}:{line}: `{span}`"
        if span not in OPTIONS:
            found += [f"{where}: no profile sets {k} to {v!r}" for k, v in claims(span) if value_ok(k, v) is False]
        why = signature_problem(span)
        if why:
            found.append(f"{where}: {why}")
    return found


def test_docs_values_and_signatures_are_the_codes():
    """Every backticked `key: value` names a value the params or a profile resolve to (or is a listed
    option), and every backticked call fits the signature of the package's function or class it names."""
    assert value_problems() == []


@pytest.mark.parametrize("plant", ["`rl.max_steps: 7`", "`evaluate.limit: 9`", "`max_steps: 36, lr_scheduler: cosin`",
                                   "`HFBackend(model_dir, dtype=float32, colour=red)`",
                                   "`ops.config.load_config(Cls)`", "`resolve_profile(a, b, c, d, e)`"])
def test_a_planted_false_value_or_signature_is_found(plant, tmp_path):
    doc = tmp_path / "planted.md"
    doc.write_text(f"A claim: {plant}, beside true ones: `rl.max_steps: 15`, `init: sft`, "
                   "`load_trained(base, adapter, dtype=\"float32\")`.\n")
    assert len(value_problems([doc])) == 1, value_problems([doc])
