#!/usr/bin/env bash
# Builds llama.cpp's own tools (llama-server, llama-bench, llama-batched-bench) from the
# sources vendored in the llama-cpp-python sdist on PyPI, for the side-by-side benchmarks
# (benchmarks/llama_cpp_bench.py, benchmarks/llama_cpp_serving.sh). Nothing here is part of
# the appliance; the build lands in .bench/llama.cpp/ (ignored by git).
#
#   benchmarks/build_llama_cpp.sh            # about 12 minutes on 2 cores
#   LLAMA_CPP_PYTHON_VERSION=0.3.36 benchmarks/build_llama_cpp.sh
#
# llama.cpp is built as its README says for a CPU (GGML_NATIVE: tuned for this CPU), which
# is the fastest it can be here: the bar we measure against.
set -euo pipefail
cd "$(dirname "$0")/.."
version=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
root=.bench/llama.cpp
mkdir -p "$root"
if [ ! -f "$root/llama_cpp_python-$version.tar.gz" ]; then
  python3 -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$root"
fi
if [ ! -d "$root/src-$version" ]; then
  mkdir -p "$root/src-$version"
  tar xzf "$root/llama_cpp_python-$version.tar.gz" -C "$root/src-$version" --strip-components=1
fi
cmake -S "$root/src-$version/vendor/llama.cpp" -B "$root/build-$version" \
  -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON >/dev/null
cmake --build "$root/build-$version" -j "$(nproc)" \
  --target llama-server llama-bench llama-batched-bench >/dev/null
ln -sfn "build-$version/bin" "$root/bin"
echo "built: $root/bin/{llama-server,llama-bench,llama-batched-bench}"
