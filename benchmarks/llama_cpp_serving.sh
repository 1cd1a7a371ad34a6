#!/usr/bin/env bash
# Serving at 16 concurrent streams: llama.cpp's own llama-server (-np 16 -t 2) against
# `appliance serve` in each pool layout, the same closed-loop load from `appliance bench`
# (fixed 260-token prompts, 128 tokens out, ignore_eos), one after the other on this
# machine's cores. Tables land in benchmarks/results/llama_cpp_serving/.
# A layout is a pool mode, `colocated` or `disaggregated`, and may end in `-waitN`: then
# batch.prefill_wait_steps=N (new prompts wait up to N steps while others decode, to
# prefill together). WORKLOAD=chat runs appliance bench's chat mix instead (prompts
# mostly 50-500 tokens, answers 32-256) into llama_cpp_serving_chat/.
#
#   benchmarks/build_llama_cpp.sh && benchmarks/llama_cpp_serving.sh    # about 10 minutes
#   NUM_REQUESTS=96 LAYOUTS="colocated" benchmarks/llama_cpp_serving.sh
set -euo pipefail
cd "$(dirname "$0")/.."
workload=${WORKLOAD:-fixed}
[[ $workload == fixed || $workload == chat ]] || { echo "WORKLOAD is fixed or chat" >&2; exit 1; }
out=benchmarks/results/llama_cpp_serving$([[ $workload == fixed ]] || echo "_$workload")
bin=${LLAMA_BIN:-.bench/llama.cpp/bin}
model=$(.venv/bin/python -c "from appliance.model.loader import default_model_path as d; print(d())")
port=8931
load=(--workload "$workload" --input-len 260 --output-len 128 --concurrency 16
      --num-requests "${NUM_REQUESTS:-64}" --warmup 4 --seed 0
      --extra-body '{"ignore_eos": true}')
mkdir -p "$out"

wait_for() {  # URL: until it answers, at most 120 s
  for _ in $(seq 240); do curl -sf "$1" >/dev/null && return 0; sleep 0.5; done
  echo "no answer from $1" >&2; return 1
}

slot=$([[ $workload == fixed ]] && echo 512 || echo 1536)  # context a stream
"$bin/llama-server" -m "$model" -t "$(nproc)" -np 16 -c $((16 * slot)) --host 127.0.0.1 \
  --port $port >"$out/llama-server.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
wait_for "http://127.0.0.1:$port/v1/models"
.venv/bin/appliance bench "${load[@]}" --url "http://127.0.0.1:$port" \
  --label "llama-server -np 16" --out "$out/llama-server"
kill $server; wait $server 2>/dev/null || true

for layout in ${LAYOUTS:-colocated colocated-wait32 disaggregated}; do
  [[ $layout =~ ^(colocated|disaggregated)(-wait([0-9]+))?$ ]] ||
    { echo "layout $layout: colocated or disaggregated, optionally -waitN" >&2; exit 1; }
  mode=${BASH_REMATCH[1]} hold=${BASH_REMATCH[3]:-0}
  APPLIANCE_PORT=$port APPLIANCE_MODE=$mode APPLIANCE_BATCH__PREFILL_WAIT_STEPS=$hold \
    .venv/bin/appliance serve >"$out/appliance-$layout.log" 2>&1 &
  server=$!
  wait_for "http://127.0.0.1:$port/health"  # 503 until every worker has loaded
  .venv/bin/appliance bench "${load[@]}" --url "http://127.0.0.1:$port" \
    --label "appliance $layout" --out "$out/appliance-$layout"
  kill -TERM $server; wait $server 2>/dev/null || true
done
