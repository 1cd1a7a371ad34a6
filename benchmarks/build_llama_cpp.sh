#!/usr/bin/env bash
# Builds llama.cpp's own tools (llama-server, llama-bench, llama-batched-bench) and its
# lookup-decoding example (llama-lookup: prompt lookup drafts, one verify pass; with
# --spec-draft-n-max 0 the same loop decodes plainly) from the sources vendored in the
# llama-cpp-python sdist on PyPI, for the side-by-side benchmarks
# (benchmarks/llama_cpp_bench.py, benchmarks/llama_cpp_serving.sh,
# benchmarks/speculative_bench.py). Nothing here is part of
# the appliance; the build lands in .bench/llama.cpp/ (ignored by git).
#
#   benchmarks/build_llama_cpp.sh            # about 12 minutes on 2 cores
#   LLAMA_CPP_PYTHON_VERSION=0.3.36 benchmarks/build_llama_cpp.sh
#   LLAMA_CPP_ISA=avx2 benchmarks/build_llama_cpp.sh   # AVX2 + FMA + F16C only: bin-avx2/
#
# llama.cpp is built as its README says for a CPU (GGML_NATIVE: tuned for this CPU), which
# is the fastest it can be here: the bar we measure against. LLAMA_CPP_ISA=avx2 builds it
# for an AVX2 CPU without AVX-512 instead, to set against our avx2 kernels (cpu_isa=avx2)
# on a machine that has more.
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
isa=${LLAMA_CPP_ISA:-native}
case "$isa" in
  native) flags=(-DGGML_NATIVE=ON); build="build-$version"; bin=bin ;;
  avx2) flags=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
               -DGGML_AVX512=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF)
        build="build-$version-avx2"; bin=bin-avx2 ;;
  *) echo "LLAMA_CPP_ISA is native or avx2, not $isa" >&2; exit 2 ;;
esac
cmake -S "$root/src-$version/vendor/llama.cpp" -B "$root/$build" \
  -DCMAKE_BUILD_TYPE=Release "${flags[@]}" -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON >/dev/null
cmake --build "$root/$build" -j "$(nproc)" \
  --target llama-server llama-bench llama-batched-bench llama-lookup >/dev/null
ln -sfn "$build/bin" "$root/$bin"
echo "built: $root/$bin/{llama-server,llama-bench,llama-batched-bench,llama-lookup}"
