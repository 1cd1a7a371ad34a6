#!/usr/bin/env bash
# The fault tests (killed and stalled workers, restarts, re-runs) RUNS times in a row
# (default 5) while another process keeps one core busy: a busy machine must not take
# their preconditions away (each waits until the worker holds requests, then kills it).
#
#   benchmarks/faults_under_load.sh        # about 6 minutes on 2 cores
set -uo pipefail
cd "$(dirname "$0")/.."
yes >/dev/null &
busy=$!
trap 'kill $busy' EXIT
failed=0
for i in $(seq "${RUNS:-5}"); do
  start=$(date +%s)
  .venv/bin/python -m pytest -q -p no:cacheprovider tests/server/test_faults.py | tail -1
  rc=${PIPESTATUS[0]}
  echo "run $i: rc $rc, $(($(date +%s) - start)) s"
  [[ $rc == 0 ]] || failed=1
done
exit $failed
