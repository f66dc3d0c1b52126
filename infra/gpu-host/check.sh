#!/usr/bin/env bash
# The GPU check in one device call (docs/gpu-run.md "The GPU check"): the project's CUDA tests and the rollout
# bench on a host with CUDA, Python 3.12 and torch but no package index, one log back in $OUT.
#
#   here:   infra/gpu-host/check.sh pack               .gpucheck/: the wheels the host lacks, the model spec
#   there:  infra/gpu-host/check.sh run                (carry .gpucheck) -> $OUT/gpu-check.log
#   here:   infra/gpu-host/check.sh run --device cpu   the dry run: the same steps on the CPU, tiny sizes
#
# `run` steps, each under its own time cap and all inside CHECK_BUDGET_S (default 340 s): install the wheels
# into a site folder; build a random-init model of the configured architecture with the real tokenizer
# (make_model.py; decode speed does not depend on the weights); the `gpu`-marked tests; the rollout bench at
# its three shapes (engine beside naive `generate`); training and evaluation seconds on that model (an SFT
# step, an RC-GRPO step, an evaluate batch: bench/train_steps.py, the numbers also in $OUT/train-steps.json);
# the device-relevant test modules with CUDA present (the suite's device: RCGRPO_TEST_DEVICE). A step that
# fails or runs out of time is logged and the next runs; the log ends with one line per step (exit status,
# seconds). Exit status: 0 when every step passed.
set -uo pipefail
cd "$(dirname "$0")/../.."
PACK=${PACK:-.gpucheck}
here=infra/gpu-host

# The project's pins the host's own versions do not meet, and what it lacks (the host has torch, accelerate,
# pandas, pyarrow, matplotlib, rich, psutil, pyyaml, pytest): at this venv's versions, no dependencies.
PINNED="trl transformers peft datasets dill multiprocess bfcl-eval typer pytest-xdist execnet"
# MLflow (the stages' tracking, a sqlite store) with its closure, less what the host already has.
MLFLOW="mlflow-skinny sqlalchemy alembic"
HOST_HAS="anyio certifi charset_normalizer click cloudpickle h11 idna markupsafe packaging protobuf pyyaml
          requests typing_extensions urllib3 zipp"
PLATFORM=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
          --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
MAX_PACK_MIB=60
# Test modules whose tests place models, decode or train (the rest of the suite does not touch a device).
DEVICE_TESTS="tests/test_graphs.py tests/test_prefill.py tests/test_device.py tests/test_decoder.py
              tests/test_backends.py tests/test_engine.py tests/test_guidance.py tests/test_rl.py
              tests/test_rl_offpolicy.py tests/test_rl_tokens.py tests/test_sft.py tests/test_evaluate.py
              tests/test_controllability.py"

pins() {  # name==version of each argument, from this venv
  "$1" - "${@:2}" <<'PY'
import importlib.metadata as md, sys
print(" ".join(f"{n}=={md.version(n)}" for n in sys.argv[1:]))
PY
}

pack() {
  local py=${PY:-.venv/bin/python}
  rm -rf "$PACK" && mkdir -p "$PACK/wheels" "$PACK/model"
  # shellcheck disable=SC2046
  "$py" -m pip download -q --no-deps "${PLATFORM[@]}" -d "$PACK/wheels" $(pins "$py" $PINNED) || return 1
  # shellcheck disable=SC2046
  "$py" -m pip download -q "${PLATFORM[@]}" -d "$PACK/wheels" $(pins "$py" $MLFLOW) || return 1
  for have in $HOST_HAS; do rm -f "$PACK"/wheels/"$have"-[0-9]*.whl; done
  "$py" "$here/make_model.py" spec --params params.yaml --out "$PACK/model" || return 1
  local mib; mib=$(du -sm "$PACK" | cut -f1)
  echo "pack: $PACK $(du -sh "$PACK" | cut -f1) ($(ls "$PACK/wheels" | wc -l) wheels; limit $MAX_PACK_MIB MiB)"
  [ "$mib" -le "$MAX_PACK_MIB" ] || { echo "pack: over $MAX_PACK_MIB MiB" >&2; return 1; }
}

# -- run ----------------------------------------------------------------------------------------------
STEPS=()
step() {  # step NAME CAP_S CMD...: CMD under min(CAP_S, what the budget has left), logged with its status
  local name=$1 cap=$2; shift 2
  local left=$(( BUDGET - ($(date +%s) - START) ))
  (( cap > left )) && cap=$left
  if (( cap <= 5 )); then STEPS+=("$name: skipped (budget spent)"); echo "== $name: skipped (budget spent)"; return; fi
  echo "== $name (cap ${cap}s): $*"
  local t0; t0=$(date +%s)
  # SIGINT first: pytest then stops at the test it is in and still prints its summary
  timeout -s INT -k 10 "$cap" "$@" 2>&1
  local rc=$?
  STEPS+=("$name: exit $rc, $(( $(date +%s) - t0 )) s$([ $rc = 124 ] && echo ' (time cap)')")
  echo "== $name: exit $rc"
}

run() {
  local device=cuda
  while [ $# -gt 0 ]; do
    case $1 in --device) device=$2; shift 2;; *) echo "run: unknown argument $1" >&2; return 2;; esac
  done
  BUDGET=${CHECK_BUDGET_S:-340}; START=$(date +%s)
  local out=${OUT:-/tmp/gpucheck-out} work=${WORK:-/tmp/gpucheck-work}
  local site=$work/site model=$work/model
  mkdir -p "$out" && rm -rf "$work" && mkdir -p "$work"
  local py dtype tiny shapes tests xdist=()
  if [ "$device" = cpu ]; then  # the dry run: this venv, tiny sizes; the wheels install into a folder nobody imports
    py=${PY:-.venv/bin/python}; dtype=float32; tiny=--tiny
    shapes=("--entries 2 --g 2 --protocol paper --max-new-tokens 8"
            "--entries 4 --g 2 --protocol paper --max-new-tokens 8 --arms engine"
            "--prompts 8 --g 2 --prompt-len 64 --max-new-tokens 8")
    tests=${TEST_MODULES:-tests/test_graphs.py tests/test_prefill.py tests/test_device.py tests/test_engine.py}
    export PYTHONPATH=$PWD
  else
    py=${PY:-python3}; dtype=bfloat16; tiny=
    shapes=("--entries 16 --g 5 --protocol paper --max-new-tokens 128"
            "--entries 64 --g 5 --protocol paper --max-new-tokens 128 --arms engine"
            "--prompts 256 --g 4 --prompt-len 350 --max-new-tokens 64")
    tests=${TEST_MODULES:-$DEVICE_TESTS}
    export PYTHONPATH=$site:$PWD
  fi
  export RCGRPO_TEST_DEVICE=$device RCGRPO_TOKENIZER_DIR=$PWD/$PACK/model PYTHONUNBUFFERED=1
  export MLFLOW_TRACKING_URI=sqlite:///$work/mlflow.db
  {
    echo "gpu check: device $device, $(date -u +%FT%TZ), budget ${BUDGET}s," \
         "commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
    [ -d "$PACK/wheels" ] || { echo "no $PACK/wheels: run 'check.sh pack' here and carry $PACK"; exit 2; }
    local install=("$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site")
    [ "$device" = cpu ] && install+=("${PLATFORM[@]}")
    step setup 90 "${install[@]}" "$PACK"/wheels/*.whl
    step versions 60 "$py" -c "import torch, transformers, trl, peft, mlflow; print('torch', torch.__version__,
      'cuda', torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else '',
      '| transformers', transformers.__version__, '| trl', trl.__version__, '| peft', peft.__version__,
      '| mlflow', mlflow.__version__)"
    step model 60 "$py" "$here/make_model.py" build --spec "$PACK/model" --out "$model" --dtype "$dtype" $tiny
    local workers=$(( $(nproc) / 2 )); (( workers > 8 )) && workers=8; (( workers < 1 )) && workers=1
    "$py" -c "import xdist" 2>/dev/null && xdist=(-n "$workers" --dist loadfile)  # whole modules per worker
    local pytest=("$py" -m pytest -q -p no:cacheprovider --tb=short -rfE)
    # shellcheck disable=SC2046
    step gpu-tests 90 "${pytest[@]}" -m gpu $(grep -l "mark.gpu" tests/test_*.py)
    local i=1
    for shape in "${shapes[@]}"; do
      # shellcheck disable=SC2086
      step "bench-$i" 100 "$py" bench/rollout_throughput.py --model "$model" --device "$device" --dtype "$dtype" $shape
      i=$((i + 1))
    done
    # shellcheck disable=SC2086
    step train-steps 90 "$py" bench/train_steps.py --model "$model" --device "$device" --dtype "$dtype" $tiny \
      --out "$out/train-steps.json"
    # shellcheck disable=SC2086
    step device-tests 240 "${pytest[@]}" "${xdist[@]}" -m "not slow and not gpu" --durations=8 $tests
    echo "== summary (device $device, $(( $(date +%s) - START )) s of ${BUDGET}s)"
    printf '%s\n' "${STEPS[@]}"
    ! printf '%s\n' "${STEPS[@]}" | grep -qv ": exit 0,"
  } 2>&1 | tee "$out/gpu-check.log"
  local rc=${PIPESTATUS[0]}
  echo "log: $out/gpu-check.log"
  return "$rc"
}

case ${1:-} in
  pack) pack ;;
  run) shift; run "$@" ;;
  *) echo "usage: $0 pack | run [--device cuda|cpu]" >&2; exit 2 ;;
esac
