#!/usr/bin/env bash
# On the GPU host, in the project root, after setup.sh: installs p4's wheels into the same site folder and
# unpacks the up-to-date stages' outputs, then checks that the quality gate imports. Afterwards:
# rcgrpo run-plan --plan <p4>/plan.json --bundle <file> (docs/gpu-run.md).
#   bash infra/gpu-host/setup-plan.sh [P4]      (P4: .gpuhost/p4)
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "$0")/lib.sh"
p4=${1:-.gpuhost/p4}
install_wheels python3 "$SITE" "$p4"/wheels/*.whl
tar -xzf "$p4/outputs.tar.gz"
PYTHONPATH="$SITE:$PWD" python3 -c "import great_expectations as gx; print('great_expectations', gx.__version__)"
