#!/usr/bin/env bash
# llama.cpp, CPU only, for the tests that run our GGUF models and adapters in llama.cpp itself
# (tests/integrations/test_llama_cpp.py): the llama.cpp that llama-cpp-python 0.3.36's source
# distribution vendors (llama.cpp 0c1e57098), fetched from PyPI with pip and checked against its
# SHA-256, built as the llama library alone, and scripts/llama-logits.c (the driver the tests run)
# linked against it.
#
#   bash scripts/llama-cpp.sh [FOLDER]     # default .ci-cache/llama.cpp; safe to run again
#   FOLDER/bin/llama-logits                # what the tests run (TORCH_WGPU_LORA_LLAMA_CPP=FOLDER
#                                          # points them at another folder)
#
# The library is built once (about 5 minutes on 2 cores) and kept in FOLDER (lib/, include/,
# about 7 MB; the source and build trees are removed); the driver is compiled again on each run
# (a second). Built with GGML_NATIVE=OFF and every x86 extension off, so that a cached FOLDER runs
# on any x86-64 host; tiny models need no vector units. cmake and g++ are installed (as root) when
# missing.
set -euo pipefail
cd "$(dirname "$0")/.."
folder="$(realpath -m "${1:-.ci-cache/llama.cpp}")"
version=0.3.36
sha256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
flags=(-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DGGML_NATIVE=OFF -DGGML_SSE42=OFF -DGGML_AVX=OFF
       -DGGML_AVX2=OFF -DGGML_BMI2=OFF -DGGML_FMA=OFF -DGGML_F16C=OFF -DGGML_OPENMP=OFF -DGGML_CCACHE=OFF
       -DLLAMA_BUILD_COMMON=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
       -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF
       "-DCMAKE_INSTALL_RPATH=\$ORIGIN")
stamp="llama-cpp-python $version ${flags[*]}"

if [ "$(cat "$folder/stamp" 2>/dev/null)" != "$stamp" ]; then
  if ! command -v cmake >/dev/null || ! command -v c++ >/dev/null || ! command -v cc >/dev/null; then
    if [ "$(id -u)" -ne 0 ]; then
      echo "llama-cpp: cmake and a C/C++ compiler are needed: apt-get install cmake g++" >&2
      exit 1
    fi
    echo "llama-cpp: installing cmake and g++"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq cmake g++ >/dev/null
  fi
  rm -rf "$folder"
  work="$folder.work"
  rm -rf "$work"
  mkdir -p "$work"
  python=python3
  [ -x .venv/bin/python ] && python=.venv/bin/python
  "$python" -m pip download -q --no-deps --no-binary :all: -d "$work" "llama-cpp-python==$version"
  archive="$work/llama_cpp_python-$version.tar.gz"
  echo "$sha256  $archive" | sha256sum -c --quiet -
  tar -xzf "$archive" -C "$work" "llama_cpp_python-$version/vendor/llama.cpp"
  cmake -S "$work/llama_cpp_python-$version/vendor/llama.cpp" -B "$work/build" -DCMAKE_INSTALL_PREFIX="$folder" \
        "${flags[@]}" >"$work/configure.log"
  cmake --build "$work/build" -j 2 >"$work/build.log"
  cmake --install "$work/build" >/dev/null
  rm -rf "$work"
  echo "$stamp" > "$folder/stamp"
fi
mkdir -p "$folder/bin"
cc -O2 -std=c11 -o "$folder/bin/llama-logits" scripts/llama-logits.c -I"$folder/include" -L"$folder/lib" -lllama -lggml-base \
   -Wl,-rpath,'$ORIGIN/../lib'
