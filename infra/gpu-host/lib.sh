# shellcheck shell=bash disable=SC2034  # the variables are for the scripts that source it
# The GPU kit's shared part (infra/README.md "The GPU kit"; docs/gpu-run.md): THE wheel set the host lacks,
# THE platform those wheels are for, THE way they are downloaded here and installed there, the host's paths.
# Every script in infra/gpu-host sources it; sourced, it only defines. Run as a command, it calls one of its
# functions, so a time-capped step can run one (check.sh):
#   source "$(dirname "$0")/lib.sh"
#   bash infra/gpu-host/lib.sh install_wheels python3 /tmp/gpuhost-site .gpuhost/p3/wheels/*.whl

# The host's paths (dryrun.sh points each into its own folder). WORK: the lease run's copy of the project
# (start-run.sh); SITE: the installed wheels; STASH: the GGUF's parts, outside the tree the device tool
# re-syncs on every call; ENV_FILE: what setup.sh leaves, the line that puts SITE and the project on the path.
WORK=${WORK:-/root/work}
SITE=${SITE:-/tmp/gpuhost-site}
STASH=${STASH:-/root/gpuhost-stash}
ENV_FILE=${ENV_FILE:-/tmp/gpuhost.env}

# The one wheel set, for both kits (the lease's p3, the check's .gpucheck), at this venv's versions: the
# project's pins that the host's own versions do not meet and what it lacks, without their dependencies
# (gguf: the embedded model's loader; pytest-xdist and execnet: the check's test workers) ...
PROJECT_WHEELS="trl transformers peft datasets dill multiprocess bfcl-eval gguf typer pytest-xdist execnet"
# ... and MLflow (the stages' tracking, a sqlite store) with its closure, less what the host image already has
# (besides torch, accelerate, numpy, pandas, pyarrow, matplotlib, rich, psutil, pyyaml and pytest).
MLFLOW_WHEELS="mlflow-skinny sqlalchemy alembic"
HOST_HAS="anyio certifi charset_normalizer click cloudpickle h11 idna markupsafe packaging protobuf pyyaml
          requests typing_extensions urllib3 zipp"
# The lease's quality gate (p4, pack-plan.sh): Great Expectations and the part of its closure the host image
# (numpy, pandas, scipy, jinja2, requests, ...) lacks; pack-plan.sh drops what the set above already brings.
GX_WHEELS="great-expectations altair cryptography cffi pycparser jsonschema jsonschema-specifications referencing
           rpds-py marshmallow mistune ruamel.yaml tzlocal"
# What the host installs: CPython 3.12 manylinux wheels for x86_64, nothing built from source.
PLATFORM=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
          --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
# One call carries at most 64 MiB, the working tree (a few MiB) included.
MAX_CARRY_MIB=60
# What setup.sh and the check print: the versions the host imports.
VERSIONS_PY="import torch, transformers, trl, peft, mlflow
cuda = torch.cuda.is_available()
print('torch', torch.__version__, 'cuda', cuda, torch.cuda.get_device_name() if cuda else '',
      '| transformers', transformers.__version__, '| trl', trl.__version__, '| peft', peft.__version__,
      '| mlflow', mlflow.__version__)"

pins() {  # pins PY NAME...: name==version of each, as PY's environment has it (the versions the tests ran with)
  "$1" - "${@:2}" <<'PY'
import importlib.metadata as md, sys
print(" ".join(f"{n}=={md.version(n)}" for n in sys.argv[1:]))
PY
}

fetch_wheels() {  # fetch_wheels PY DIR [PIP_OPTION...] -- NAME...: NAME at PY's version, as host wheels, into DIR
  local py=$1 dir=$2 opts=() reqs; shift 2
  while [ "$1" != -- ]; do opts+=("$1"); shift; done; shift
  reqs=$(pins "$py" "$@")
  # shellcheck disable=SC2086  # name==version words
  "$py" -m pip download -q "${opts[@]}" "${PLATFORM[@]}" -d "$dir" $reqs
}

download_wheels() {  # download_wheels PY DIR: the one wheel set (both kits) into DIR
  local have
  # shellcheck disable=SC2086  # the lists are words
  fetch_wheels "$1" "$2" --no-deps -- $PROJECT_WHEELS
  # shellcheck disable=SC2086
  fetch_wheels "$1" "$2" -- $MLFLOW_WHEELS
  shopt -s nocaseglob  # a wheel's name keeps its project's case (PyYAML-...)
  for have in $HOST_HAS; do rm -f "$2/$have"-[0-9]*.whl; done
  shopt -u nocaseglob
}

install_wheels() {  # install_wheels PY SITE WHEEL...: into SITE, no index, no dependencies; --upgrade: p4's
  # wheels go in beside p3's. GPUHOST_DRYRUN=1 (the dry runs, on a CPU host of another Python): pip checks
  # that each is a wheel for the host's platform and installs it into SITE/unused, which nothing imports.
  local py=$1 site=$2; shift 2
  local pip=("$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade)
  if [ "${GPUHOST_DRYRUN:-0}" = 1 ]; then
    "${pip[@]}" "${PLATFORM[@]}" --target "$site/unused" "$@"
  else
    "${pip[@]}" --target "$site" "$@"
  fi
}

have_wheels() {  # have_wheels PY SITE: fails naming each package of the one wheel set that SITE lacks
  local dir=$2
  [ "${GPUHOST_DRYRUN:-0}" = 1 ] && dir=$2/unused
  # shellcheck disable=SC2086  # the lists are words
  "$1" - "$dir" $PROJECT_WHEELS $MLFLOW_WHEELS <<'PY'
import re, sys
from pathlib import Path

def norm(name):
    return re.sub(r"[-_.]+", "_", name).lower()

site, names = Path(sys.argv[1]), sys.argv[2:]
have = {norm(p.name.split("-")[0]) for p in site.glob("*.dist-info")}
missing = [n for n in names if norm(n) not in have]
print(f"{site}: {len(names) - len(missing)} of the kit's {len(names)} packages installed")
sys.exit(f"{site} lacks {' '.join(missing)}" if missing else 0)
PY
}

new_payloads() {  # new_payloads OUT PART...: OUT/PART made afresh for each PART; OUT kept out of git status
  local out=$1 exclude part; shift
  exclude=$(git rev-parse --git-path info/exclude)  # a worktree's .git is a file
  mkdir -p "$(dirname "$exclude")" && touch "$exclude"
  grep -qxF "/$out/" "$exclude" || echo "/$out/" >> "$exclude"
  for part in "$@"; do rm -rf "${out:?}/$part" && mkdir -p "$out/$part"; done
}

check_size() {  # check_size DIR...: their sizes; fails when together they weigh more than one call carries
  local mib
  mib=$(du -scm "$@" | tail -n 1 | cut -f1)
  du -sh "$@"
  [ "$mib" -le "$MAX_CARRY_MIB" ] || { echo "over $MAX_CARRY_MIB MiB for one call: $* ($mib MiB)" >&2; return 1; }
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then  # run as a command: lib.sh FUNCTION ARG...
  set -euo pipefail
  "$@"
fi
