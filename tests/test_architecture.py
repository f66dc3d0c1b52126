"""The package's shape: layers point one way, no import cycles, no private names crossing modules,
no in-function imports of the package, no module over 400 lines. `lint-imports` checks the layer contract in
pyproject.toml; these tests check what a layer contract cannot express."""

from __future__ import annotations

import ast
import types
from pathlib import Path

import grimp
import pytest
import yaml

PKG = Path(__file__).resolve().parents[1] / "rcgrpo_tasks"
LIB = PKG.parent / "rcgrpo"
"""The public library (`import rcgrpo`): one folder dep of every stage that imports any of it."""
MODULES = sorted(PKG.rglob("*.py"))
LIB_MODULES = sorted(LIB.rglob("*.py"))
MAX_LINES = 400


def _name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _package_imports(tree: ast.AST):
    """(node, imported module, names) of every import of the package, at any depth."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("rcgrpo_tasks"):
            yield node, node.module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("rcgrpo_tasks"):
                    yield node, alias.name, []


def test_no_import_cycles_counting_in_function_imports():
    graph = grimp.build_graph("rcgrpo_tasks")  # grimp reads every import statement, nested ones included
    cycles = []
    for module in sorted(graph.modules):
        for imported in graph.find_modules_directly_imported_by(module):
            back = graph.find_shortest_chain(importer=imported, imported=module)
            if back:
                cycles.append((module, *back))
    assert not cycles, f"import cycles: {cycles[:5]}"


@pytest.mark.parametrize("path", MODULES + LIB_MODULES, ids=lambda p: str(p.relative_to(PKG.parent)))
def test_module_shape(path: Path):
    text = path.read_text()
    assert len(text.splitlines()) <= MAX_LINES, f"{path.name}: over {MAX_LINES} lines"
    tree = ast.parse(text)
    top_level = {id(n) for n in tree.body}
    for node, module, names in _package_imports(tree):
        assert id(node) in top_level, f"{path.name}:{node.lineno}: in-function import of {module}"
        private = [n for n in names if n.startswith("_")]
        assert not private, f"{path.name}:{node.lineno}: private name(s) {private} imported from {module}"


def test_the_checker_sees_in_function_imports(tmp_path):
    """The shape test would catch a lazy package import and a private name (guards the test itself)."""
    tree = ast.parse("def f():\n    from rcgrpo_tasks.env.bfcl import _read_jsonl\n")
    (node, module, names), = list(_package_imports(tree))
    assert module == "rcgrpo_tasks.env.bfcl" and names == ["_read_jsonl"] and node not in tree.body


STAGES = sorted((PKG / "stages").glob("*.py"))


@pytest.mark.parametrize("path", STAGES, ids=lambda p: p.name)
def test_stage_modules_hold_no_config_class(path: Path):
    """One rule for configs: every stage config lives in the library beside the code it configures."""
    tree = ast.parse(path.read_text())
    classes = [n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
    assert not classes, f"{path.name}: defines {classes}; stage configs live in the library (docs/DEVELOPING.md)"


def test_every_stage_module_is_a_command():
    """stages/ is exactly the commands `rcgrpo` dispatches to."""
    from rcgrpo_tasks.cli import COMMANDS

    modules = {m for m, _ in COMMANDS.values()}
    assert modules == {f"rcgrpo_tasks.stages.{p.stem}" for p in STAGES if p.stem != "__init__"}


def test_the_reward_tokens_have_one_loader_and_one_check():
    """Every stage reads the pipeline's reward tokens through `data.labels.load_reward_tokens`, and a list of them
    is checked by the library's one check (`rcgrpo.goal.check_levels`): the pipeline defines no check of its own
    and no alias of a library name (`format_goal`, `DEFAULT_LEVELS`, `place_goal`, `remove_goal`)."""
    import rcgrpo.goal

    readers, own = [], []
    library = {n for n, v in vars(rcgrpo.goal).items() if not n.startswith("_") and not isinstance(v, types.ModuleType)
               and getattr(v, "__module__", "rcgrpo.goal") == "rcgrpo.goal"}  # what goal.py itself defines
    for path in MODULES:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            func = node.func if isinstance(node, ast.Call) else None
            if getattr(func, "id", getattr(func, "attr", "")) == "reward_tokens":
                readers.append(_name(path))
            if isinstance(node, ast.FunctionDef) and ("check_reward_tokens" in node.name or "reward_goal" in node.name):
                own.append(f"{_name(path)}.{node.name}")
            if isinstance(node, ast.Assign) and any(getattr(t, "id", "") in library | {"DEFAULT_REWARD_TOKENS"}
                                                    for t in node.targets):
                own.append(f"{_name(path)}: {[getattr(t, 'id', '') for t in node.targets]}")
    assert readers == ["rcgrpo_tasks.data.labels"], f"reward_tokens(...) called outside the loader: {readers}"
    assert own == [], f"the pipeline's own copies of the library's goal and token checks: {own}"


def _library_folder(module: str) -> str | None:
    """The folder a dvc.yaml stage lists for a library `module`: its layer's folder (`rcgrpo_tasks/engine`), or,
    where that folder holds no module of its own (`train/`: the wings `sft/`, `rl/` and `common/`), the
    subpackage's (`rcgrpo_tasks/train/rl`); None for a module outside a folder (`cli`) or an empty container
    `__init__`."""
    parts = module.split(".")[1:]
    folder = PKG
    for depth, part in enumerate(parts, 1):
        folder = folder / part
        if not folder.is_dir():
            return None
        if any(p.name != "__init__.py" or p.read_text().strip() for p in folder.glob("*.py")):
            return "/".join(["rcgrpo_tasks", *parts[:depth]])
    return None


def test_dvc_stages_list_every_library_folder_they_import():
    """A stage's deps in dvc.yaml name every library folder its module imports, directly or through other
    modules (in-function imports included), and no other: a change there reruns exactly the stages that
    can see it (a training stage lists its wing and `train/common`, never the other wing)."""
    graph = grimp.build_graph("rcgrpo_tasks", "rcgrpo", exclude_type_checking_imports=True)
    stages = yaml.safe_load((PKG.parent / "dvc.yaml").read_text())["stages"]
    wrong = {}
    for stage, spec in stages.items():
        deps = spec.get("do", spec)["deps"]
        module = next(d for d in deps if d.startswith("rcgrpo_tasks/stages/"))
        imported = graph.find_upstream_modules(_name(PKG.parent / module))
        need = {_library_folder(m) for m in imported if m.startswith("rcgrpo_tasks.") and m.count(".") >= 1
                and m.split(".")[1] != "stages"} - {None}
        # the library's modules, file by file: a change to its trainer reruns the RL stages, not the evaluations
        lib = {"rcgrpo/" + "/".join([*m.split(".")[1:]] or ["__init__"]) + ".py"
               for m in imported if m == "rcgrpo" or m.startswith("rcgrpo.")}
        need |= lib | ({"rcgrpo/__init__.py"} if lib else set())  # a submodule's import runs the package's init
        listed = {d.rstrip("/") for d in deps if (d.startswith("rcgrpo_tasks/") and not d.endswith(".py"))
                  or d.startswith("rcgrpo/")}
        if need != listed:
            wrong[stage] = {"missing": sorted(need - listed), "not imported": sorted(listed - need)}
    assert not wrong, f"dvc.yaml code deps differ from the stage modules' imports: {wrong}"


EVALUATION_STAGES = ("evaluate", "controllability", "report", "promote")


@pytest.mark.parametrize("stage", EVALUATION_STAGES)
def test_evaluation_stages_see_no_training_code(stage: str):
    """A change to a trainer (its config included) never reruns an evaluation: the stages that evaluate a model
    import no module of `train/`, directly or through others (the layers contract keeps `evaluation/` from it;
    a stage module sits above both and could still import it)."""
    graph = grimp.build_graph("rcgrpo_tasks")
    seen = sorted(m for m in graph.find_upstream_modules(f"rcgrpo_tasks.stages.{stage}")
                  if m.startswith("rcgrpo_tasks.train"))
    assert not seen, f"stages/{stage}.py sees training code: {seen}"
