#!/usr/bin/env bash
# On the GPU host, in the repo copy the device tool made, with .gpuhost/p3 and .gpuhost/p4 carried and p1, p2
# already stashed (docs/gpu-run.md). Copies the project to $WORK first: the device tool re-syncs the working
# tree on every call, which would put this checkout's tracked metrics back over the run's own. Then sets
# the host up (setup.sh with p3, setup-plan.sh with p4) and starts, detached so later calls can poll it:
#   1. `rcgrpo run-plan --stage prepare_model` (models/base: the base model, and the GPU check's model spec);
#   2. with CHECKS=1: the GPU check (check.sh run, on the wheels and models/base this lease set up), its log
#      run/checks.log;
#   3. the whole plan (`rcgrpo run-plan --jobs $JOBS`: stages side by side on the one GPU), its bundle
#      rewritten after every stage;
#   4. with AFTER set: that command once the plan succeeded (e.g. the dev sweep, docs/rl.md "Chosen on dev").
# Returns at once; `infra/gpu-host/poll.sh` waits on it and copies what exists to $OUT.
# JOBS (default 4), CHECKS (default 0: a lease-sized run spends its minutes on the pipeline; the check can
# also run in a call of its own once the run ended), STAGES (run-plan --stage targets, space-separated;
# default: the whole plan), AFTER, and lib.sh's WORK, ENV_FILE, SITE override the defaults; GPUHOST_DRYRUN=1
# is dryrun.sh's.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "$0")/lib.sh"
CHECKS=${CHECKS:-0}; JOBS=${JOBS:-4}; STAGES=${STAGES:-}; AFTER=${AFTER:-}
targets=""; for t in $STAGES; do targets="$targets --stage $t"; done
rm -rf "$WORK" && mkdir -p "$WORK" && tar -cf - . | tar -xf - -C "$WORK" && cd "$WORK"
bash infra/gpu-host/setup.sh .gpuhost/p3
bash infra/gpu-host/setup-plan.sh .gpuhost/p4
mkdir -p run
cat > run/job.sh <<JOB
set -uo pipefail
source "$ENV_FILE"
cd "$WORK"
plan=(rcgrpo run-plan --plan .gpuhost/p4/plan.json --logs run/logs)
"\${plan[@]}" --stage prepare_model --bundle run/prepare.tar.gz   # its wall time: prepare.tar.gz
if [ "$CHECKS" = 1 ]; then
  ENV_FILE="$ENV_FILE" OUT=run/check bash infra/gpu-host/check.sh run > run/checks.log 2>&1
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
