#!/usr/bin/env bash
# The lease kit's CPU dry run (docs/gpu-run.md "A run inside one lease"), so it cannot rot between GPU runs:
# the same commands in the same order, here, with a copy of the working tree standing in for the user's
# checkout and another for the GPU host; the same profile with the smoke budgets and a tiny random-init
# model of the configured architecture as `prepare_model.source` (`make_model.py --tiny`: minutes, not an
# hour, on 2 cores); then, in a further call carrying nothing, the GPU check on what the lease set up
# (check.sh run --device cpu: the lease's site folder and models/base). `make gpu-dryrun`; DRY (default
# /tmp/rcgrpo-gpudry) holds everything; exit 0 when the bundle came back with every stage of the plan run or
# skipped and every step of the check passed.
#   What only the GPU host exercises: CUDA, the wheels on its Python 3.12 (here they are only checked to be
#   Python 3.12 manylinux wheels), the embedded GGUF as the model (here its parts are joined and checked,
#   then the tiny model stands in), the RL pool rule (a random model solves nothing: `rl.pool_band`
#   is off here).
set -euo pipefail
src=$(cd "$(dirname "$0")/../.." && pwd)
venv=${VENV:-$src/.venv}
PROFILE=${PROFILE:-gpu+lease}
DRY=${DRY:-/tmp/rcgrpo-gpudry}
export PATH="$venv/bin:$PATH" PY="$venv/bin/python"
rm -rf "$DRY" && mkdir -p "$DRY"/here "$DRY"/host "$DRY"/out
# the working tree as git sees it; a tracked file deleted in it is passed over
copy_tree() { (cd "$1" && git ls-files -co --exclude-standard -z | tar --null --ignore-failed-read -cf - -T - 2>/dev/null) | tar -xf - -C "$2"; }
t0=$(date +%s)
say() { echo "[dryrun $(( $(date +%s) - t0 )) s] $*"; }

say "here: the user's checkout ($DRY/here), profile $PROFILE + the dry run's sizes"
copy_tree "$src" "$DRY/here"
cd "$DRY/here"
git init -q && git add -A && git -c user.name=dryrun -c user.email=dryrun@localhost commit -qm "dry run"
"$PY" infra/gpu-host/make_model.py spec --params params.yaml --out "$DRY/spec"
"$PY" infra/gpu-host/make_model.py build --spec "$DRY/spec" --out "$DRY/tiny-model" --dtype float32 --tiny
cat > "$DRY/tiny.yaml" <<YAML
prepare_model: {source: $DRY/tiny-model}
rl: {pool_band: null}
YAML
rcgrpo params --profile "$PROFILE+smoke+dryrun+$DRY/tiny.yaml"
dvc repro -q validate_trajectories label_rewards@sft
infra/gpu-host/pack.sh
infra/gpu-host/pack-plan.sh

say "there: the GPU host ($DRY/host), calls 1-3 as docs/gpu-run.md lists them, then polls"
copy_tree "$DRY/here" "$DRY/host"
cp -r "$DRY/here/.git" "$DRY/host/"  # as the device tool's copy: a checkout whose HEAD has the hand-written params
export STASH="$DRY/stash" SITE="$DRY/site" WORK="$DRY/work" ENV_FILE="$DRY/gpuhost.env" GPUHOST_DRYRUN=1
export CHECK_WORK="$DRY/check"
export JOBS=${JOBS:-2}
# The host has python3 and the system's tools, not this venv's commands: `rcgrpo` must come from the kit.
mkdir -p "$DRY/pybin"  # a wrapper, not a link: a linked venv python does not find its venv
printf '#!/bin/sh\nexec "%s" "$@"\n' "$venv/bin/python" > "$DRY/pybin/python3" && chmod +x "$DRY/pybin/python3"
host_path="$DRY/pybin:/usr/local/bin:/usr/bin:/bin"
call() {  # call N PARTS... -- CMD: the payloads carried into the host's tree, then CMD there with $OUT
  local n=$1; shift; local parts=()
  while [ "$1" != -- ]; do parts+=("$1"); shift; done; shift
  rm -rf "$DRY/host/.gpuhost" && mkdir -p "$DRY/host/.gpuhost"
  for p in "${parts[@]}"; do cp -r "$DRY/here/.gpuhost/$p" "$DRY/host/.gpuhost/"; done
  mkdir -p "$DRY/out/call$n"
  say "call $n (carry ${parts[*]:-nothing}): $*"
  (cd "$DRY/host" && OUT="$DRY/out/call$n" PATH="$host_path" bash -c "$*")
}
call 1 p1 -- bash infra/gpu-host/stash.sh p1
call 2 p2 -- bash infra/gpu-host/stash.sh p2
call 3 p3 p4 -- "bash infra/gpu-host/start-run.sh && bash infra/gpu-host/poll.sh 540"
n=4
until [ -f "$WORK/run/exit_code" ]; do call $n -- bash infra/gpu-host/poll.sh 540; n=$((n + 1)); done

say "back here: the bundle"
bundle=$(find "$DRY/out" -name bundle.tar.gz -printf '%T@ %p\n' | sort -n | tail -n 1 | cut -d' ' -f2-)
mkdir -p "$DRY/back" && tar -xzf "$bundle" -C "$DRY/back"
"$PY" - "$DRY/back/timings.json" <<'PY'
import json, sys
t = json.load(open(sys.argv[1]))
bad = {k: v["status"] for k, v in t["stages"].items() if v["status"] not in ("ran", "skipped")}
print(f"bundle: {len(t['stages'])} stages, wall {t['wall_s']} s, stages run {t['stage_wall_s_sum']} s")
for k, v in t["stages"].items():
    print(f"  {k:<28} {v['status']:<8} {v['wall_s']:>7.1f}")
sys.exit(f"dry run: stages not run or failed: {bad}" if bad else 0)
PY
[ "$(cat "$WORK/run/exit_code")" = 0 ] || { say "run-plan exit code $(cat "$WORK/run/exit_code")"; exit 1; }

say "there, the same lease: the GPU check on the lease's wheels and models/base (docs/gpu-run.md)"
call $n -- TEST_MODULES=tests/test_device.py bash infra/gpu-host/check.sh run --device cpu
say "done: report $DRY/back/results/report/table.md, check log $DRY/out/call$n/gpu-check.log"
