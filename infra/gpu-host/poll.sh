#!/usr/bin/env bash
# On the GPU host: wait up to SECONDS (default 540, inside one device call's 10 minutes) for the run that
# start-run.sh began, returning early when it ends; print the end of its log; copy the bundle, the log, the
# checks' output and AFTER's (its log, run/sweep.tar.gz when it writes one) to $OUT (the device tool brings
# them back). Run it back to back until run/exit_code exists, so the machine is never idle long enough to be
# given back.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "$0")/lib.sh"
wait_s=${1:-540}
[ -f "$WORK/run/log" ] || { echo "poll: no run in $WORK: start-run.sh starts one" >&2; exit 2; }
end=$(( $(date +%s) + wait_s ))
while [ ! -f "$WORK/run/exit_code" ] && [ "$(date +%s)" -lt "$end" ]; do sleep 10; done
{ grep -E '^\[run-plan\]|error' "$WORK/run/log" || true; } | tail -n 40
tail -n 5 "$WORK/run/log"
[ ! -f "$WORK/run/exit_code" ] || echo "run-plan exit code: $(cat "$WORK/run/exit_code")"
nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader 2>/dev/null || true
if [ -n "${OUT:-}" ]; then
  for f in run/bundle.tar.gz run/prepare.tar.gz run/log run/checks.log run/after.log run/sweep.tar.gz; do
    [ ! -f "$WORK/$f" ] || cp "$WORK/$f" "$OUT/"
  done
fi
