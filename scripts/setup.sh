#!/usr/bin/env bash
# One-time set-up on a fresh machine, safe to run again: a WebGPU adapter (Mesa's CPU
# Vulkan driver when the machine has no GPU driver), then .venv with the pinned test set.
set -euo pipefail
cd "$(dirname "$0")/.."

has_vulkan_driver() {  # any driver manifest in the loader's usual folders (ls of all three failed if one was missing)
  local manifest
  for manifest in /usr/share/vulkan/icd.d/*.json /etc/vulkan/icd.d/*.json /usr/local/share/vulkan/icd.d/*.json; do
    [ -e "$manifest" ] && return 0
  done
  return 1
}
if ! has_vulkan_driver; then
  echo "setup: no Vulkan driver found; installing Mesa's CPU Vulkan driver (lavapipe)"
  if [ "$(id -u)" -eq 0 ]; then sudo=""; elif command -v sudo >/dev/null; then sudo="sudo"; else
    echo "setup: run as root or install mesa-vulkan-drivers yourself (apt-get install mesa-vulkan-drivers)" >&2; exit 1
  fi
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq mesa-vulkan-drivers >/dev/null
fi

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -r requirements-test.txt
.venv/bin/python -m ipykernel install --sys-prefix --name python3 >/dev/null
echo "setup: ready ($(.venv/bin/python -c 'import torch_wgpu_lora as t; print(t.device_info()["adapter"])' 2>/dev/null))"
