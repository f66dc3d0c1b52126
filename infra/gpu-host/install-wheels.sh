#!/usr/bin/env bash
# On the GPU host, in the project root: install carried wheels into the site folder, no index, no
# dependencies (p3's setup.sh and p4's setup-plan.sh). GPUHOST_DRYRUN=1 (infra/gpu-host/dryrun.sh, a CPU host
# of another Python): pip checks that each is a Python 3.12 manylinux wheel and installs it into
# $SITE/unused, which nothing imports.
#   bash infra/gpu-host/install-wheels.sh SITE WHEEL...
set -euo pipefail
site=${1:?usage: install-wheels.sh SITE WHEEL...}; shift
pip=(python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir)
if [ "${GPUHOST_DRYRUN:-0}" = 1 ]; then
  "${pip[@]}" --target "$site/unused" --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 "$@"
else
  "${pip[@]}" --upgrade --target "$site" "$@"
fi
