#!/usr/bin/env bash
# The fourth payload for a GPU host without a package index (after infra/gpu-host/pack.sh's p1-p3): what
# `rcgrpo run-plan` needs there beyond them.
#   - plan.json: the pipeline as DVC resolves it here (`rcgrpo plan`), each stage marked up to date or not;
#   - outputs.tar.gz: the outputs of the up-to-date stages that p3 does not carry (the trajectory set and
#     its quality-gate folder); the base model is rebuilt there by prepare_model, byte for byte;
#   - wheels/: Great Expectations and the part of its closure the host lacks (lib.sh's GX_WHEELS: the quality
#     gate runs again there on the SFT model's own samples), at the versions this project's venv tests with.
# setup-plan.sh installs them there. Run from the project root, with the profile applied and its data
# stages done:
#   rcgrpo params --profile gpu && dvc repro validate_trajectories label_rewards@sft
#   infra/gpu-host/pack.sh && infra/gpu-host/pack-plan.sh [OUT]
set -euo pipefail
out=${1:-.gpuhost}
py=${PY:-.venv/bin/python}
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "$0")/lib.sh"
new_payloads "$out" p4
PATH="$(dirname "$py"):$PATH" rcgrpo plan --out "$out/p4/plan.json" --outputs-archive "$out/p4/outputs.tar.gz" \
  --max-output-mb 16
# shellcheck disable=SC2086  # the list is words
fetch_wheels "$py" "$out/p4/wheels" --no-deps -- $GX_WHEELS
for wheel in "$out"/p4/wheels/*.whl; do  # what p3's set already brings (cryptography, with MLflow) travels once
  [ ! -f "$out/p3/wheels/${wheel##*/}" ] || rm "$wheel"
done
check_size "$out/p4"
[ ! -d "$out/p3" ] || check_size "$out/p3" "$out/p4"  # call 3 carries both
