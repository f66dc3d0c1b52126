#!/usr/bin/env bash
# On the GPU host, in the repo copy the device tool made, with .gpuhost/p3 and .gpuhost/p4 carried and p1, p2
# already stashed (docs/gpu-run.md). Copies the project to $WORK first: the device tool re-syncs the working
# tree on every call, which would put this checkout's tracked metrics back over the run's own. Then sets
# the host up (p3's setup.sh, p4's setup-plan.sh) and starts, detached so later calls can poll it:
#   1. `rcgrpo run-plan --stage prepare_model` (the base model the checks decode with);
#   2. with CHECKS=1: the `gpu`-marked tests and the CUDA rollout bench (engine beside the naive loop);
#   3. the whole plan (`rcgrpo run-plan --jobs $JOBS`: stages side by side on the one GPU), its bundle
#      rewritten after every stage;
#   4. with AFTER set: that command once the plan succeeded (e.g. the dev sweep, docs/rl.md "Chosen on dev").
# Returns at once; `infra/gpu-host/poll.sh` waits on it and copies what exists to $OUT.
# JOBS (default 4), CHECKS (default 0: a lease-sized run spends its minutes on the pipeline; the GPU check
# is its own call), STAGES (run-plan --stage targets, space-separated; default: the whole plan), AFTER, WORK,
# ENV_FILE override the defaults; GPUHOST_DRYRUN=1 is infra/gpu-host/dryrun.sh's.
set -euo pipefail
WORK=${WORK:-/root/work}; ENV_FILE=${ENV_FILE:-/tmp/gpuhost.env}
CHECKS=${CHECKS:-0}; JOBS=${JOBS:-4}; STAGES=${STAGES:-}; AFTER=${AFTER:-}
targets=""; for t in $STAGES; do targets="$targets --stage $t"; done
src=$PWD
rm -rf "$WORK" && mkdir -p "$WORK" && cd "$src" && tar -cf - . | tar -xf - -C "$WORK" && cd "$WORK"
ENV_FILE=$ENV_FILE bash .gpuhost/p3/setup.sh
# shellcheck disable=SC1090
source "$ENV_FILE"
bash .gpuhost/p4/setup-plan.sh
mkdir -p run
cat > run/job.sh <<JOB
set -uo pipefail
source "$ENV_FILE"
cd "$WORK"
plan=(rcgrpo run-plan --plan .gpuhost/p4/plan.json --logs run/logs)
"\${plan[@]}" --stage prepare_model --bundle run/prepare.tar.gz   # its wall time: prepare.tar.gz
if [ "$CHECKS" = 1 ]; then
  { python3 -m pytest -q -m gpu tests/ 2>&1 | tail -n 30
    python3 bench/rollout_throughput.py --model models/base --device cuda --dtype bfloat16 --entries 16 --g 5 \
      --protocol paper --max-new-tokens 128 2>&1 | tail -n 30
  } > run/checks.log 2>&1
fi
"\${plan[@]}" --jobs $JOBS --bundle run/bundle.tar.gz $targets
rc=\$?
if [ \$rc = 0 ] && [ -n "$AFTER" ]; then
  echo "[run-plan] after: $AFTER"
  $AFTER > run/after.log 2>&1
  rc=\$?
  echo "[run-plan] after: exit \$rc"
fi
echo \$rc > run/exit_code
JOB
setsid nohup bash run/job.sh > run/log 2>&1 < /dev/null &
echo "started in $WORK (pid $!): poll with infra/gpu-host/poll.sh"
