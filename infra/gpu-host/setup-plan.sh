#!/usr/bin/env bash
# On the GPU host, in the project root, after p3's setup.sh and `source /tmp/gpuhost.env`: installs p4's
# wheels into the same site folder and unpacks the up-to-date stages' outputs, then checks that the quality
# gate imports. Afterwards: rcgrpo run-plan --plan <p4>/plan.json --bundle <file> (see docs/gpu-run.md).
set -euo pipefail
p4=$(cd "$(dirname "$0")" && pwd); SITE=${SITE:-/tmp/gpuhost-site}
install=(python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE")
if [ "${GPUHOST_DRYRUN:-0}" = 1 ]; then  # as p3's setup.sh: checked, installed where nothing imports them
  install=(python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE/unused"
           --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
fi
"${install[@]}" "$p4"/wheels/*.whl
tar -xzf "$p4/outputs.tar.gz"
PYTHONPATH="$SITE:$PWD" python3 -c "import great_expectations as gx; print('great_expectations', gx.__version__)"
