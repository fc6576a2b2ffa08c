# The environment of the machine benchmarks/RESULTS.md's H200 figures come from: an NVIDIA
# driver without the Vulkan loader, Python 3.12 with torch (CUDA), transformers and peft, and no
# network. On a machine with a network, from the repository's root, once:
#     bash scripts/h200_env.sh download    # the loader's .deb files into .gl/, wgpu's wheels into .whl/
# then copy the checkout (with .gl/ and .whl/) to the GPU machine and, from its root:
#     . scripts/h200_env.sh && python3 -m torch_wgpu_lora.benchmarks.engine --out OUT --repeats 3 --train-steps 5
# Sourcing unpacks the loader into / (a throwaway machine's), installs the wheels into
# /tmp/site and points the loader at NVIDIA's Vulkan driver.

if [ "${1:-}" = download ]; then
    set -eu
    mkdir -p .gl .whl /tmp/amd64/partial
    apt_opts='-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists=/tmp/amd64'
    apt-get $apt_opts update -qq
    (cd .gl && apt-get $apt_opts download -qq libvulkan1 libegl1 libglvnd0 libopengl0 libgl1 libglx0 libgles2)
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl wgpu==0.32.0 cffi pycparser rendercanvas
    exit 0
fi
if ! (return 0 2>/dev/null); then
    echo "usage: bash scripts/h200_env.sh download; then, on the GPU machine: . scripts/h200_env.sh" >&2
    exit 2
fi
for deb in .gl/*.deb; do dpkg -x "$deb" /; done
ldconfig
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || return 1
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
export PYTHONUNBUFFERED=1
