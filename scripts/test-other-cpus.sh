#!/usr/bin/env bash
# The README's test command as other CPUs compute. torch's kernels, MKL and lavapipe each pick a
# code path by the CPU they find, and CI hosts are Intel or AMD, with or without AVX-512: a test
# that depends on how one CPU rounds passes on one host and fails on another. Two runs, each
# setting what another host would pick:
#   avx2     torch's kernels at AVX2, MKL's AVX2 path, lavapipe's 128-bit vectors
#   default  torch's kernels unvectorised, MKL's reproducible path (MKL_CBWR=COMPATIBLE)
# Each run is a whole suite (about 6 minutes on 2 idle cores). Arguments go to pytest, e.g.
# `bash scripts/test-other-cpus.sh tests/integrations`. Run scripts/setup.sh first. Exits
# non-zero if either run failed; inductor's compiled kernels are cached per CPU capability
# (torch_wgpu_lora/runtime/device.py says why), so the runs can share its cache.
set -uo pipefail
cd "$(dirname "$0")/.."

failed=()
run() {
  local name=$1
  shift
  echo "== $name: $*"
  env "$@" .venv/bin/python -c 'import torch, torch_wgpu_lora as t
print("torch CPU capability", torch.backends.cpu.get_cpu_capability() + ", adapter", t.device_info()["adapter"])'
  env "$@" .venv/bin/python -m pytest "${args[@]}" || failed+=("$name")
}

args=("$@")
run avx2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 LP_NATIVE_VECTOR_WIDTH=128
run default ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE
if [ ${#failed[@]} -gt 0 ]; then
  echo "test-other-cpus: failed under ${failed[*]}" >&2
  exit 1
fi
echo "test-other-cpus: passed under avx2 and default"
