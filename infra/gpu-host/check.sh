#!/usr/bin/env bash
# The GPU check in one device call (docs/gpu-run.md "The GPU check"): the project's CUDA tests and the rollout
# bench on a host with CUDA, Python 3.12 and torch but no package index, one log back in $OUT.
#
#   here:   infra/gpu-host/check.sh pack               .gpucheck/: the kit's wheel set (lib.sh), the model spec
#   there:  infra/gpu-host/check.sh run                (carry .gpucheck) -> $OUT/gpu-check.log
#   there, after a lease run's setup (docs/gpu-run.md "The GPU check after a lease run"), carrying nothing:
#           infra/gpu-host/check.sh run                the wheels setup.sh installed ($ENV_FILE names them),
#                                                      the model spec from the lease's models/base
#   here:   infra/gpu-host/check.sh run --device cpu   the dry run: the same steps on the CPU, tiny sizes
#
# `run` steps, each under its own time cap and all inside CHECK_BUDGET_S (default 340 s): install the carried
# wheels into a site folder (after a lease: check that its site folder holds the whole set); build a
# random-init model of the configured architecture with the real tokenizer (make_model.py; decode speed does
# not depend on the weights); the `gpu`-marked tests; the rollout bench at its three shapes (engine beside
# naive `generate`); training and evaluation seconds on that model (an SFT step, an RC-GRPO step, an
# evaluate batch: bench/train_steps.py, the numbers also in $OUT/train-steps.json); the device-relevant test
# modules with CUDA present (the suite's device: RCGRPO_TEST_DEVICE). A step that fails or runs out of time
# is logged and the next runs; the log ends with one line per step (exit status, seconds). Exit status: 0
# when every step passed. TEST_MODULES, CHECK_BUDGET_S, OUT, CHECK_WORK (its scratch folder), PACK override.
set -euo pipefail
cd "$(dirname "$0")/../.."
here=infra/gpu-host
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$here/lib.sh"
PACK=${PACK:-.gpucheck}
# Test modules whose tests place models, decode or train (the rest of the suite does not touch a device).
DEVICE_TESTS="tests/test_graphs.py tests/test_prefill.py tests/test_device.py tests/test_decoder.py
              tests/test_backends.py tests/test_engine.py tests/test_guidance.py tests/test_rl.py
              tests/test_rl_offpolicy.py tests/test_rl_tokens.py tests/test_sft.py tests/test_evaluate.py
              tests/test_controllability.py"

pack() {
  local py=${PY:-.venv/bin/python}
  rm -rf "$PACK" && mkdir -p "$PACK/model"
  download_wheels "$py" "$PACK/wheels"
  "$py" "$here/make_model.py" spec --params params.yaml --out "$PACK/model"
  echo "pack: $PACK, $(find "$PACK/wheels" -name '*.whl' | wc -l) wheels"
  check_size "$PACK"
}

# -- run ----------------------------------------------------------------------------------------------
STEPS=()
step() {  # step NAME CAP_S CMD...: CMD under min(CAP_S, what the budget has left), logged with its status
  local name=$1 cap=$2; shift 2
  local left=$(( BUDGET - ($(date +%s) - START) ))
  if (( cap > left )); then cap=$left; fi
  if (( cap <= 5 )); then STEPS+=("$name: skipped (budget spent)"); echo "== $name: skipped (budget spent)"; return; fi
  echo "== $name (cap ${cap}s): $*"
  local t0 rc=0; t0=$(date +%s)
  # SIGINT first: pytest then stops at the test it is in and still prints its summary
  timeout -s INT -k 10 "$cap" "$@" 2>&1 || rc=$?
  STEPS+=("$name: exit $rc, $(( $(date +%s) - t0 )) s$([ $rc = 124 ] && echo ' (time cap)')")
  echo "== $name: exit $rc"
}

sources() {  # sets site, spec, lease: the carried pack, else what a lease's setup.sh left on this host
  if [ -d "$PACK/wheels" ]; then
    site=$cw/site spec=$PWD/$PACK/model lease=
    echo "wheels and model spec: $PACK (carried)"
  elif [ -f "$ENV_FILE" ]; then
    # shellcheck source=/dev/null
    source "$ENV_FILE"  # GPUHOST_SITE, GPUHOST_ROOT: the lease's site folder and project copy
    site=$GPUHOST_SITE lease=$GPUHOST_ROOT spec=$GPUHOST_ROOT/models/base
    [ -f "$spec/config.json" ] || spec=$cw/spec  # no models/base yet: the spec from the lease's params.yaml
    echo "wheels: the lease's $site ($ENV_FILE); model spec: $spec"
    if [ -d "$lease/run" ] && [ ! -f "$lease/run/exit_code" ]; then
      echo "note: the lease's run in $lease has not ended (no run/exit_code): it may share this GPU"
    fi
  else
    echo "no $PACK/wheels and no lease set up here ($ENV_FILE): carry $PACK ('check.sh pack' here), or run" \
         "the lease's setup first (docs/gpu-run.md)"
    return 2
  fi
}

checks() {  # the steps, in the environment run() set up
  local site spec lease
  sources || exit 2
  export RCGRPO_TOKENIZER_DIR=$spec MLFLOW_TRACKING_URI=sqlite:///$cw/mlflow.db PYTHONUNBUFFERED=1
  if [ "$device" = cpu ]; then export PYTHONPATH=$PWD; else export PYTHONPATH=$site:$PWD; fi
  if [ -z "$lease" ]; then
    step setup 90 bash "$here/lib.sh" install_wheels "$py" "$site" "$PACK"/wheels/*.whl
  else
    step setup 30 bash "$here/lib.sh" have_wheels "$py" "$site"
    [ "$spec" != "$cw/spec" ] || step spec 60 "$py" "$here/make_model.py" spec --params "$lease/params.yaml" --out "$spec"
  fi
  step versions 60 "$py" -c "$VERSIONS_PY"
  # shellcheck disable=SC2086  # $tiny: empty or one flag
  step model 60 "$py" "$here/make_model.py" build --spec "$spec" --out "$cw/model" --dtype "$dtype" $tiny
  local workers=$(( $(nproc) / 2 )) xdist=()
  if (( workers > 8 )); then workers=8; elif (( workers < 1 )); then workers=1; fi
  if "$py" -c "import xdist" 2>/dev/null; then xdist=(-n "$workers" --dist loadfile); fi  # whole modules per worker
  local pytest=("$py" -m pytest -q -p no:cacheprovider --tb=short -rfE)
  # shellcheck disable=SC2046
  step gpu-tests 90 "${pytest[@]}" -m gpu $(grep -l "mark.gpu" tests/test_*.py)
  local i=1 shape
  for shape in "${shapes[@]}"; do
    # shellcheck disable=SC2086  # a shape is several arguments
    step "bench-$i" 100 "$py" bench/rollout_throughput.py --model "$cw/model" --device "$device" --dtype "$dtype" $shape
    i=$((i + 1))
  done
  # shellcheck disable=SC2086
  step train-steps 90 "$py" bench/train_steps.py --model "$cw/model" --device "$device" --dtype "$dtype" $tiny \
    --out "$out/train-steps.json"
  # shellcheck disable=SC2086
  step device-tests 240 "${pytest[@]}" "${xdist[@]}" -m "not slow and not gpu" --durations=8 $tests
  echo "== summary (device $device, $(( $(date +%s) - START )) s of ${BUDGET}s)"
  printf '%s\n' "${STEPS[@]}"
  ! printf '%s\n' "${STEPS[@]}" | grep -qv ": exit 0,"
}

run() {
  local device=cuda
  while [ $# -gt 0 ]; do
    case $1 in --device) device=$2; shift 2;; *) echo "run: unknown argument $1" >&2; return 2;; esac
  done
  BUDGET=${CHECK_BUDGET_S:-340}; START=$(date +%s)
  local out=${OUT:-/tmp/gpucheck-out} cw=${CHECK_WORK:-/tmp/gpucheck-work}
  mkdir -p "$out" && rm -rf "$cw" && mkdir -p "$cw"
  local py dtype tiny shapes tests
  if [ "$device" = cpu ]; then  # the dry run: this venv, tiny sizes; the wheels install into a folder nobody imports
    py=${PY:-.venv/bin/python}; dtype=float32; tiny=--tiny
    shapes=("--entries 2 --g 2 --protocol paper --max-new-tokens 8"
            "--entries 4 --g 2 --protocol paper --max-new-tokens 8 --arms engine"
            "--prompts 8 --g 2 --prompt-len 64 --max-new-tokens 8")
    tests=${TEST_MODULES:-tests/test_graphs.py tests/test_prefill.py tests/test_device.py tests/test_engine.py}
    export GPUHOST_DRYRUN=1
  else
    py=${PY:-python3}; dtype=bfloat16; tiny=
    shapes=("--entries 16 --g 5 --protocol paper --max-new-tokens 128"
            "--entries 64 --g 5 --protocol paper --max-new-tokens 128 --arms engine"
            "--prompts 256 --g 4 --prompt-len 350 --max-new-tokens 64")
    tests=${TEST_MODULES:-$DEVICE_TESTS}
  fi
  export RCGRPO_TEST_DEVICE=$device
  local rc=0
  {
    echo "gpu check: device $device, $(date -u +%FT%TZ), budget ${BUDGET}s," \
         "commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
    checks
  } 2>&1 | tee "$out/gpu-check.log" || rc=$?
  echo "log: $out/gpu-check.log"
  return "$rc"
}

case ${1:-} in
  pack) pack ;;
  run) shift; run "$@" ;;
  *) echo "usage: $0 pack | run [--device cuda|cpu]" >&2; exit 2 ;;
esac
