#!/usr/bin/env bash
# The vendored TRL test files (tests/trl_suite/trl_upstream/, README.md "The snapshot"), copied byte for byte.
#   bash tests/trl_suite/vendor.sh GIT_DIR   copy them from a bare clone or snapshot of huggingface/trl at $COMMIT
#                                            (GIT_DIR: the git directory, e.g. what the search tool's fetch returns)
#   bash tests/trl_suite/vendor.sh --check   check the copies against upstream.sha256
# A refresh to a newer snapshot: COMMIT=<sha> bash tests/trl_suite/vendor.sh GIT_DIR --update, then rerun
# `make test-trl-suite` and update README.md's commit and counts.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
dest="$here/trl_upstream"
sums="$here/upstream.sha256"
COMMIT="${COMMIT:-f2cd57710ae345ea6428ae95363267fcf38a3dc8}"
FILES=(tests/__init__.py tests/conftest.py tests/testing_utils.py tests/test_grpo_trainer.py LICENSE)

if [[ "${1:-}" == "--check" ]]; then
    cd "$dest" && sha256sum --quiet -c "$sums"
    echo "trl_upstream/: the files of huggingface/trl $(head -c 12 <<<"$COMMIT"), unmodified"
    exit 0
fi
git_dir="${1:?usage: vendor.sh GIT_DIR [--update] | --check}"
mkdir -p "$dest"
for f in "${FILES[@]}"; do
    git --git-dir="$git_dir" show "$COMMIT:$f" > "$dest/$(basename "$f")"
done
if [[ "${2:-}" == "--update" ]]; then
    (cd "$dest" && sha256sum "${FILES[@]##*/}" > "$sums")
    sed -i "s/^COMMIT=.*/COMMIT=\"\${COMMIT:-$COMMIT}\"/" "$0"
fi
cd "$dest" && sha256sum --quiet -c "$sums" && echo "copied huggingface/trl $COMMIT into $dest"
