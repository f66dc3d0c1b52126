"""infra/gpu-host, the GPU kit, cannot run here (no GPU host): check it is one kit. The wheel platform, the
pins function, the host's package list and the wheel installer exist once (lib.sh) and every script uses
them; the lease's wheel set holds what the GPU check needs; the scripts parse and stay strict."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest
from helpers import REPO_ROOT

KIT = REPO_ROOT / "infra" / "gpu-host"
LIB = KIT / "lib.sh"
SCRIPTS = sorted(p for p in KIT.glob("*.sh") if p != LIB)


def _files():
    return {p.name: p.read_text() for p in sorted(KIT.iterdir()) if p.is_file()}


@pytest.mark.parametrize(
    "pattern, what",
    [
        (r"manylinux_2_28_x86_64", "the wheel platform"),
        (r"--python-version", "the host's Python"),
        (r"importlib\.metadata", "the pins (versions read from the venv)"),
        (r"charset_normalizer", "the list of what the host already has"),
        (r"pip\s+download\b", "the pip call that fetches wheels"),
        (r"pip\s+install\b", "the pip call that installs wheels"),
        (r"^\s*(function\s+)?pins\s*\(\)", "the pins function"),
        (r"^\s*(function\s+)?install_wheels\s*\(\)", "the wheel installer"),
        (r"\bmlflow-skinny\b", "the wheel set"),
        (r"\bgreat-expectations\b", "the quality gate's wheels"),
    ],
)
def test_each_piece_of_the_kit_exists_once_in_lib_sh(pattern, what):
    where = {name: len(re.findall(pattern, text, re.M)) for name, text in _files().items()}
    where = {name: n for name, n in where.items() if n}
    assert where == {"lib.sh": 1}, f"{what} must be written once, in lib.sh: found in {where}"


def test_every_script_is_strict_and_sources_the_library():
    assert {p.name for p in SCRIPTS} >= {"check.sh", "pack.sh", "pack-plan.sh", "setup.sh", "setup-plan.sh",
                                          "start-run.sh", "stash.sh", "poll.sh", "dryrun.sh"}
    for script in SCRIPTS:
        text = script.read_text()
        assert re.search(r"^set -euo pipefail$", text, re.M), f"{script.name}: no `set -euo pipefail`"
        if script.name != "dryrun.sh":  # it only calls the others, as a user would
            assert re.search(r'^source .*/lib\.sh"$', text, re.M), f"{script.name} does not source lib.sh"


def test_the_one_wheel_set_holds_what_the_check_needs():
    out = subprocess.run(["bash", "-c", f'source "{LIB}"; echo $PROJECT_WHEELS; echo $MLFLOW_WHEELS'],
                         capture_output=True, text=True, check=True).stdout.split()
    # the check's test workers, the model spec's loader, the stages' tracking and the pinned stack
    assert {"pytest-xdist", "execnet", "gguf", "mlflow-skinny", "transformers", "trl", "peft"} <= set(out)
    # both kits download that one set: the lease's p3 (pack.sh) and the check's pack
    for name in ("pack.sh", "check.sh"):
        assert re.search(r"^\s*download_wheels ", (KIT / name).read_text(), re.M), name


def test_have_wheels_names_what_a_site_folder_lacks(tmp_path):
    for dist in ("trl-1.0.dist-info", "pytest_xdist-3.8.0.dist-info", "SQLAlchemy-2.1.dist-info"):
        (tmp_path / dist).mkdir()
    run = subprocess.run(["bash", str(LIB), "have_wheels", sys.executable, str(tmp_path)],
                         capture_output=True, text=True, env={"PATH": "/usr/bin:/bin", "GPUHOST_DRYRUN": "0"})
    assert run.returncode != 0
    lacks = run.stderr.strip().split(" lacks ")[1].split()
    assert "execnet" in lacks and "transformers" in lacks
    assert "trl" not in lacks and "pytest-xdist" not in lacks and "sqlalchemy" not in lacks


def test_scripts_parse_and_pass_shellcheck():
    for script in [LIB, *SCRIPTS]:
        parsed = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert parsed.returncode == 0, (script.name, parsed.stderr)
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck)")
    run = subprocess.run(["shellcheck", "-x", *(p.name for p in [LIB, *SCRIPTS])], cwd=KIT,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout


def test_infra_readme_describes_every_file_of_the_kit():
    readme = (REPO_ROOT / "infra" / "README.md").read_text()
    missing = [name for name in _files() if name not in readme]
    assert not missing, f"infra/README.md does not describe {missing}"
