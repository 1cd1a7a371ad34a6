#!/usr/bin/env bash
# The same serving load on two git revisions, alternating on this machine's cores: to show
# that a change inside the appliance (a refactor) leaves serving as it was.
#
#   benchmarks/serving_ab.sh BEFORE_REV AFTER_REV [OUT]    # ROUNDS=4 STREAMS_ONLY=1: ~12 min
#
# Each revision is checked out in a worktree and run with this checkout's .venv and its
# built CPU kernels (copied in: the worktree has no build). The editable install's finder
# is dropped (a sitecustomize on PYTHONPATH) so `appliance` comes from the worktree alone:
# with `python -m` only, a package the worktree lacks (or has without __init__.py) would
# still be taken from this checkout. Spawned workers inherit PYTHONPATH. Two loads:
#   - one rate of the serving comparison: `appliance bench compare --configs ours` on the
#     long-prompt burst mix at RATE (default 0.5 req/s), every pool layout (skipped with
#     STREAMS_ONLY=1);
#   - the 16-stream closed loop of benchmarks/llama_cpp_serving.sh (260-token prompts,
#     128 tokens out, ignore_eos) against `appliance serve` colocated and disaggregated,
#     ROUNDS times (default 2), the revisions alternating, the order flipped each round.
# Tables land in OUT (default /tmp/serving_ab)/<rev>/; the stream rows are printed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
python=$root/.venv/bin/python
out=${3:-/tmp/serving_ab}
port=8932
stream_load=(--workload fixed --input-len 260 --output-len 128 --concurrency 16
             --num-requests "${NUM_REQUESTS:-32}" --warmup 4 --seed 0
             --extra-body '{"ignore_eos": true}')
site=$(mktemp -d /tmp/serving_ab_site.XXXX)
cat >"$site/sitecustomize.py" <<'PY'
import sys
sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in type(f).__module__
                    and "__editable__" not in getattr(f, "__module__", "")]
sys.path[:] = [p for p in sys.path if "__editable__" not in p]
sys.path_hooks[:] = [h for h in sys.path_hooks if "editable" not in repr(h)]
sys.path_importer_cache.clear()
PY
declare -A trees

wait_for() {  # URL: until it answers, at most 180 s
  for _ in $(seq 360); do curl -sf "$1" >/dev/null && return 0; sleep 0.5; done
  echo "no answer from $1" >&2; return 1
}

checkout() {  # REV: a worktree with this checkout's built kernels
  local tree
  tree=$(mktemp -d /tmp/serving_ab_tree.XXXX)
  git worktree add -q --detach "$tree" "$1"
  cp appliance/model/_cpu_kernels_*.so "$tree/appliance/model/"
  trees[$1]=$tree
}

in_tree() {  # REV CMD...: CMD inside REV's worktree, its `appliance` only
  local tree=${trees[$1]}; shift
  (cd "$tree" && PYTHONPATH="$site:$tree" "$@")
}

compare() {  # REV
  in_tree "$1" "$python" -m appliance.cli bench compare --configs ours \
    --workload long-burst --seed 0 --num-requests "${RATE_REQUESTS:-30}" --warmup 2 \
    --rates "${RATE:-0.5}" --goodput ttft:5000 tpot:100 --out "$out/$1/compare"
}

streams() {  # REV LAYOUT ROUND
  local server
  in_tree "$1" env APPLIANCE_PORT=$port APPLIANCE_MODE="$2" "$python" -m appliance.cli serve \
    >"$out/$1/serve-$2-$3.log" 2>&1 &
  server=$!
  wait_for "http://127.0.0.1:$port/health"
  in_tree "$1" "$python" -m appliance.cli bench "${stream_load[@]}" \
    --url "http://127.0.0.1:$port" --label "$1 $2 r$3" --out "$out/$1/streams-$2-$3" >/dev/null
  kill -TERM $server; wait $server 2>/dev/null || true
}

for rev in "$1" "$2"; do checkout "$rev"; mkdir -p "$out/$rev"; done
trap 'for t in "${trees[@]}"; do git worktree remove --force "$t"; done; rm -rf "$site"' EXIT
if [[ -z ${STREAMS_ONLY:-} ]]; then compare "$1"; compare "$2"; fi
order=("$1" "$2")
for round in $(seq "${ROUNDS:-2}"); do
  for rev in "${order[@]}"; do
    for layout in colocated disaggregated; do streams "$rev" "$layout" "$round"; done
  done
  order=("${order[1]}" "${order[0]}")
done
for rev in "$1" "$2"; do
  echo "## $rev"
  [[ -z ${STREAMS_ONLY:-} ]] && cat "$out/$rev/compare/compare.md"
  head -2 "$out/$rev/streams-colocated-1/table.md"
  for f in "$out/$rev"/streams-*/table.md; do tail -n +3 "$f"; done
done
