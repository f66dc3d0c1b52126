#!/usr/bin/env bash
# The fourth payload for a GPU host without a package index (after infra/gpu-host/pack.sh's p1-p3): what
# `rcgrpo run-plan` needs there beyond them.
#   - plan.json: the pipeline as DVC resolves it here (`rcgrpo plan`), each stage marked up to date or not;
#   - outputs.tar.gz: the outputs of the up-to-date stages that p3 does not carry (the trajectory set and
#     its quality-gate folder); the base model is rebuilt there by prepare_model, byte for byte;
#   - wheels/: Great Expectations and the part of its closure the host lacks (the quality gate runs
#     again there on the SFT model's own samples), at the versions this project's venv tests with;
#   - setup-plan.sh: installs the wheels beside p3's and unpacks the outputs.
# Run from the project root, with the profile applied and its data stages done:
#   rcgrpo params --profile gpu && dvc repro validate_trajectories label_rewards@sft
#   infra/gpu-host/pack.sh && infra/gpu-host/pack-plan.sh [OUT]
set -euo pipefail
out=${1:-.gpuhost}
py=${PY:-.venv/bin/python}
here=$(cd "$(dirname "$0")" && pwd)
exclude=$(git rev-parse --git-path info/exclude)  # a worktree's .git is a file
mkdir -p "$(dirname "$exclude")" && touch "$exclude"
grep -qxF "/$out/" "$exclude" || echo "/$out/" >> "$exclude"
rm -rf "$out/p4" && mkdir -p "$out/p4/wheels"
PATH="$(dirname "$py"):$PATH" rcgrpo plan --out "$out/p4/plan.json" --outputs-archive "$out/p4/outputs.tar.gz" \
  --max-output-mb 16
# Great Expectations' closure less what the host image has (numpy, pandas, scipy, jinja2, requests, ...) and
# what p3 brings (pydantic with MLflow): pinned to this venv's versions.
pins=$("$py" - <<'PY'
import importlib.metadata as md
names = ["great-expectations", "altair", "cryptography", "cffi", "pycparser", "jsonschema",
         "jsonschema-specifications", "referencing", "rpds-py", "marshmallow", "mistune", "ruamel.yaml", "tzlocal"]
print(" ".join(f"{n}=={md.version(n)}" for n in names))
PY
)
plat=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
# shellcheck disable=SC2086
"$py" -m pip download -q --no-deps "${plat[@]}" -d "$out/p4/wheels" $pins
cp "$here/setup-plan.sh" "$out/p4/"
du -sh "$out/p4"
