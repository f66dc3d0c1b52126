#!/usr/bin/env bash
# On the GPU host, in the project root, after p3's setup.sh and `source /tmp/gpuhost.env`: installs p4's
# wheels into the same site folder and unpacks the up-to-date stages' outputs, then checks that the quality
# gate imports. Afterwards: rcgrpo run-plan --plan <p4>/plan.json --bundle <file> (see docs/gpu-run.md).
set -euo pipefail
p4=$(cd "$(dirname "$0")" && pwd); SITE=${SITE:-/tmp/gpuhost-site}
bash infra/gpu-host/install-wheels.sh "$SITE" "$p4"/wheels/*.whl
tar -xzf "$p4/outputs.tar.gz"
PYTHONPATH="$SITE:$PWD" python3 -c "import great_expectations as gx; print('great_expectations', gx.__version__)"
