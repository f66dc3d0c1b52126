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
ELSEWHERE = ("run/", "retrain/", "eval/", "<")
"""Paths on a lent GPU host (`run/`), in a generated retrain project, or relative to a stage's argument."""
OLD_BASES = ("sft", "rl")
"""Stage bases of names that are gone (`sft@rctp`, `rl@<cell>`): still checked, so they fail."""

SPAN = re.compile(r"`([^`\n]+)`")
PLACEHOLDER = re.compile(r"<[^<>/]*>")
STAGE = re.compile(r"^[a-z_]+@[\w<>.\-]+$")
DOTTED = re.compile(r"^(?:rcgrpo_tasks\.)?([a-z_]+)((?:\.[A-Za-z_]\w*)+)$")


def spans(path: Path) -> list[tuple[int, str]]:
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        out += [(n, s.strip()) for s in SPAN.findall(line)]
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


def path_ok(text: str) -> bool:
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
    """`rcgrpo_tasks.a.b.name`: a module or package a.b (the longest that exists) defining every name after it."""
    parts = [package, *rest.strip(".").split(".")]
    for i in range(len(parts), 0, -1):
        base = REPO_ROOT / "rcgrpo_tasks" / Path(*parts[:i])
        source = base.with_suffix(".py") if base.with_suffix(".py").exists() else base / "__init__.py"
        if source.exists():
            text = source.read_text()
            return all(re.search(rf"(def|class)\s+{re.escape(n)}\b|^\s*{re.escape(n)}\s*[:=]", text, re.M)
                       or re.search(rf"\b{re.escape(n)}\b", text) for n in parts[i:])
    return False


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
                if (text.startswith("rcgrpo_tasks.") or m.group(1) in PACKAGES) and not module_ok(m.group(1),
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
