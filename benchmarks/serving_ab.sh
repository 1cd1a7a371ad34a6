#!/usr/bin/env bash
# The same serving load on two git revisions, one after the other on this machine's
# cores: to show that a change inside the appliance (a refactor) leaves serving as it was.
#
#   benchmarks/serving_ab.sh BEFORE_REV AFTER_REV [OUT]     # about 20 minutes on 2 cores
#
# Each revision is checked out in a temporary worktree and run with this checkout's
# .venv (python -m puts the worktree's `appliance` first on the path, and spawned workers
# inherit that path). Two loads, as in the committed results:
#   - one rate of the serving comparison: `appliance bench compare --configs ours` on the
#     long-prompt burst mix at RATE (default 0.5 req/s), every pool layout;
#   - the 16-stream closed loop of benchmarks/llama_cpp_serving.sh (260-token prompts,
#     128 tokens out, ignore_eos) against `appliance serve` colocated and disaggregated.
# Tables land in OUT (default /tmp/serving_ab)/<rev>/.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
python=$root/.venv/bin/python
out=${3:-/tmp/serving_ab}
port=8932
stream_load=(--workload fixed --input-len 260 --output-len 128 --concurrency 16
             --num-requests "${NUM_REQUESTS:-32}" --warmup 4 --seed 0
             --extra-body '{"ignore_eos": true}')

wait_for() {  # URL: until it answers, at most 180 s
  for _ in $(seq 360); do curl -sf "$1" >/dev/null && return 0; sleep 0.5; done
  echo "no answer from $1" >&2; return 1
}

run_revision() {  # REV
  local rev=$1 tree dest
  tree=$(mktemp -d /tmp/serving_ab_tree.XXXX)
  dest=$out/$rev
  mkdir -p "$dest"
  git worktree add -q --detach "$tree" "$rev"
  (
    cd "$tree"
    "$python" -m appliance.cli bench compare --configs ours \
      --workload long-burst --seed 0 --num-requests "${RATE_REQUESTS:-30}" --warmup 2 \
      --rates "${RATE:-0.5}" --goodput ttft:5000 tpot:100 --out "$dest/compare"
    for layout in colocated disaggregated; do
      APPLIANCE_PORT=$port APPLIANCE_MODE=$layout "$python" -m appliance.cli serve \
        >"$dest/serve-$layout.log" 2>&1 &
      server=$!
      wait_for "http://127.0.0.1:$port/health"
      "$python" -m appliance.cli bench "${stream_load[@]}" --url "http://127.0.0.1:$port" \
        --label "$rev $layout" --out "$dest/streams-$layout"
      kill -TERM $server; wait $server 2>/dev/null || true
    done
  )
  git worktree remove --force "$tree"
}

run_revision "$1"
run_revision "$2"
for rev in "$1" "$2"; do
  echo "## $rev"
  cat "$out/$rev/compare/compare.md"
  for layout in colocated disaggregated; do cat "$out/$rev/streams-$layout/table.md"; done
done
