#!/usr/bin/env bash
# The matrix-unit kernels on a CPU. Mesa 26's lavapipe (Debian trixie-backports) offers cooperative
# matrices (8 × 8 × 8: f16 → f16/f32, i8 → i32, u8 → u32), which Dawn exposes as subgroup matrices; the
# kernels are generic over the adapter's configuration, so their tests run there as on a GPU. That Mesa
# needs a newer glibc than Debian 12's, so the tests run inside a Debian 13 root made with mmdebstrap
# (about 600 MB, in FOLDER), with this checkout, its .venv and the Python that .venv points to
# bind-mounted at the same paths (a Python built against glibc 2.36 runs on 2.41). The system's Mesa
# stays as it is. As root (mmdebstrap, mount, chroot).
#
#   bash scripts/matrix-units-lavapipe.sh                 # the tests below, in .ci-cache/trixie
#   bash scripts/matrix-units-lavapipe.sh [VAR=VALUE...] -- PYTEST-ARGS  # those instead (e.g. -- -m matrix_units -k input)
#   TRIXIE_ROOT=FOLDER bash scripts/matrix-units-lavapipe.sh
#
# The tests: the matrix-unit GEMMs against their torch references (tests/engine/test_matrix_units.py,
# and the matrix-units benchmark's layouts and LM-head sections, tests/benchmarks/test_matrix_units_*.py), then the
# engine's adapter gradients against autograd with every GEMM that can run on the matrix units run
# there (TORCH_WGPU_LORA_GEMMS=matrix_units; a bfloat16 model's LM head on the f16 units, training and
# forward), with the default four input-gradient digits and with three and two.
set -euo pipefail
cd "$(dirname "$0")/.."
root="$(realpath -m "${TRIXIE_ROOT:-.ci-cache/trixie}")"
if [ "$(id -u)" -ne 0 ]; then
  echo "matrix-units-lavapipe: run as root (mmdebstrap, mount and chroot need it)" >&2
  exit 1
fi
if [ ! -x .venv/bin/python ]; then
  echo "matrix-units-lavapipe: no .venv here; run scripts/setup.sh first" >&2
  exit 1
fi
if [ ! -f "$root/.complete" ]; then
  if ! command -v mmdebstrap >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends mmdebstrap >/dev/null
  fi
  rm -rf "$root"
  mkdir -p "$(dirname "$root")"
  # g++: torch's compiler (inductor) builds kernels for some of the engine tests' reference paths
  mmdebstrap --quiet --variant=apt --include=ca-certificates,g++,mesa-vulkan-drivers/trixie-backports trixie "$root" \
    "deb http://deb.debian.org/debian trixie main" "deb http://deb.debian.org/debian trixie-backports main"
  touch "$root/.complete"
fi

python_prefix="$(dirname "$(dirname "$(readlink -f .venv/bin/python)")")"
mounts=()
cleanup() {
  local i
  for ((i = ${#mounts[@]} - 1; i >= 0; i--)); do umount "${mounts[i]}" 2>/dev/null || true; done
}
trap cleanup EXIT
bind() {  # bind-mount $1 at the same path inside the root
  mkdir -p "$root$1"
  if ! mountpoint -q "$root$1"; then
    mount --bind "$1" "$root$1"
    mounts+=("$root$1")
  fi
}
bind "$python_prefix"
bind "$PWD"
if ! mountpoint -q "$root/proc"; then
  mount -t proc proc "$root/proc"
  mounts+=("$root/proc")
fi

in_root() {  # in_root [VAR=VALUE...] -- PYTEST-ARGS: pytest from this checkout inside the root, on Dawn over Mesa 26
  local vars=()
  while [ "$1" != "--" ]; do vars+=("$1"); shift; done
  shift
  chroot "$root" env -i PATH=/usr/bin:/bin HOME=/root CI="${CI:-}" LANG=C.UTF-8 \
    VK_ICD_FILENAMES=/usr/share/vulkan/icd.d/lvp_icd.json TORCH_WGPU_LORA_BACKEND=dawn "${vars[@]}" \
    sh -c 'cd "$0" && exec .venv/bin/python -m pytest "$@"' "$PWD" -p no:cacheprovider "$@"
}
if [ "$#" -gt 0 ]; then  # [VAR=VALUE...] -- PYTEST-ARGS
  case " $* " in *" -- "*) ;; *) echo "usage: $0 [[VAR=VALUE...] -- PYTEST-ARGS]" >&2; exit 2 ;; esac
  in_root "$@"
  exit
fi
in_root -- -o addopts=-q -m matrix_units tests/engine/test_matrix_units.py tests/benchmarks/test_matrix_units_layouts.py \
  tests/benchmarks/test_matrix_units_lm_head.py
in_root TORCH_WGPU_LORA_GEMMS=matrix_units -- -o addopts=-q tests/engine/test_train.py tests/engine/test_model.py \
  tests/engine/test_generate.py -k "every_adapter_gradient_matches_autograd or twenty_engine_steps_match_twenty_torch_steps \
or fewer_input_gradient_digits or bfloat16_model or a_decoded_batch_matches"
