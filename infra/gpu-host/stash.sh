#!/usr/bin/env bash
# On the GPU host, in the device tool's copy of the project: keep one carried payload's files (the GGUF's
# parts of p1 / p2) in $STASH, outside the working tree the next call re-syncs. docs/gpu-run.md, calls 1-2.
#   bash infra/gpu-host/stash.sh p1
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "$0")/lib.sh"
part=${1:?usage: stash.sh p1|p2}; PACK=${PACK:-.gpuhost}
[ -d "$PACK/$part" ] || { echo "stash: no $PACK/$part here: carry it with this call" >&2; exit 2; }
mkdir -p "$STASH" && cp "$PACK/$part"/* "$STASH/"
ls -l "$STASH"
