#!/usr/bin/env bash
# Regenerates benchmarks/results/serving_cpu/: `appliance bench compare` on the long-prompt
# burst mix, every pool layout and the peers on this machine's cores, at a sweep of rates.
#
#   benchmarks/serving_bench.sh                      # about an hour on 2 cores
#   LLAMA_CPP_PYTHON=/path/to/python benchmarks/serving_bench.sh
#
# LLAMA_CPP_PYTHON names a Python that has `llama-cpp-python[server]`; without it (and
# without llama_cpp importable here) that peer is left out and the table says so by
# its absence.
set -euo pipefail
cd "$(dirname "$0")/.."
out=benchmarks/results/serving_cpu
peer=()
if [[ -n "${LLAMA_CPP_PYTHON:-}" ]]; then peer=(--llama-cpp-python "$LLAMA_CPP_PYTHON"); fi
.venv/bin/appliance bench compare \
    --workload long-burst --seed 0 --num-requests "${NUM_REQUESTS:-50}" --warmup 2 \
    --rates "${RATES:-0.25,0.5,0.75,1.0,1.25}" \
    --goodput ttft:"${SLO_TTFT_MS:-5000}" tpot:"${SLO_TPOT_MS:-100}" \
    --out "$out" "${peer[@]}"
rm -rf "$out/logs"
