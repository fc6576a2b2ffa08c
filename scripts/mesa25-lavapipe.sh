#!/usr/bin/env bash
# Mesa 25's CPU Vulkan driver (lavapipe) from Debian bookworm-backports, unpacked into a folder of
# its own: the system's Mesa stays as it is. Dawn (the optional backend, TORCH_WGPU_LORA_BACKEND=dawn)
# refuses Debian 12's Mesa 22.3.6 (it lacks shaderUniform*ArrayDynamicIndexing) and runs on this one.
#
#   bash scripts/mesa25-lavapipe.sh [FOLDER]     # default .ci-cache/mesa25; safe to run again
#   . FOLDER/env.sh                              # VK_ICD_FILENAMES and LD_LIBRARY_PATH for it
#
# Debian 12 (bookworm) only. Packages are fetched from the mirror the system's apt uses for bookworm,
# with a private apt state in FOLDER/apt (no source is added to the system's apt), and unpacked with
# dpkg -x (nothing is installed): the backports mesa-vulkan-drivers and each dependency the system
# lacks, or has older than it asks for (libdrm2 and libdrm-amdgpu1 on a stock Debian 12).
set -euo pipefail
cd "$(dirname "$0")/.."
folder="$(realpath -m "${1:-.ci-cache/mesa25}")"
if [ -f "$folder/env.sh" ]; then
  exit 0
fi
. /etc/os-release
if [ "${VERSION_CODENAME:-}" != "bookworm" ]; then
  echo "mesa25-lavapipe: Debian 12 (bookworm) only; this is ${PRETTY_NAME:-unknown}" >&2
  exit 1
fi

# the Debian mirror the system's apt uses for bookworm (deb822 .sources stanzas, or one-line entries)
mirror="$(cat /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '
  /^URIs:/ { uri = $2 }
  /^Suites:/ { for (i = 2; i <= NF; i++) if ($i == "bookworm") ok = 1 }
  /^[ \t]*$/ { if (ok && uri) { print uri; exit } ok = 0; uri = "" }
  END { if (ok && uri) print uri }' | head -n 1)"
if [ -z "$mirror" ]; then
  mirror="$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null | sed 's/\[[^]]*\]//' |
            awk '$1 == "deb" && $3 == "bookworm" { print $2; exit }')"
fi
if [ -z "$mirror" ]; then
  echo "mesa25-lavapipe: no bookworm source in the system's apt configuration to take the mirror from" >&2
  exit 1
fi
mkdir -p "$folder/apt/lists/partial" "$folder/apt/cache/archives/partial" "$folder/debs" "$folder/root"
cat > "$folder/apt/sources.list" <<EOF
deb $mirror bookworm main
deb $mirror bookworm-backports main
EOF
apt=(-o "Dir::Etc::SourceList=$folder/apt/sources.list" -o "Dir::Etc::SourceParts=/dev/null"
     -o "Dir::State::Lists=$folder/apt/lists" -o "Dir::Cache=$folder/apt/cache" -o "APT::Sandbox::User=root")
apt-get "${apt[@]}" update -qq

# mesa-vulkan-drivers from backports, and each of its dependencies that the system does not satisfy:
# from backports when it is the version asked for, else (not installed at all) bookworm's.
wanted=(mesa-vulkan-drivers/bookworm-backports)
depends="$(apt-cache "${apt[@]}" show mesa-vulkan-drivers/bookworm-backports | sed -n 's/^Depends: //p' | head -n 1)"
IFS=',' read -ra items <<< "$depends"
for item in "${items[@]}"; do
  item="${item%%|*}"  # the first of alternatives
  name="$(echo "$item" | awk '{print $1}' | sed 's/:any$//')"
  constraint="$(echo "$item" | sed -n 's/.*(\(.*\)).*/\1/p')"
  have="$(dpkg-query -W -f='${Version}' "$name" 2>/dev/null || true)"
  if [ -z "$have" ]; then
    wanted+=("$name")
  elif [ -n "$constraint" ]; then
    op="$(echo "$constraint" | awk '{print $1}')"
    version="$(echo "$constraint" | awk '{print $2}')"
    case "$op" in ">=") rel=ge ;; "<=") rel=le ;; ">>") rel=gt ;; "<<") rel=lt ;; "=") rel=eq ;; *) rel=ge ;; esac
    if ! dpkg --compare-versions "$have" "$rel" "$version"; then
      wanted+=("$name/bookworm-backports")
    fi
  fi
done
(cd "$folder/debs" && apt-get "${apt[@]}" download -qq "${wanted[@]}")
for deb in "$folder"/debs/*.deb; do
  dpkg -x "$deb" "$folder/root"
done

driver="$(find "$folder/root" -name libvulkan_lvp.so | head -n 1)"
libs="$(dirname "$driver")"
# the package's manifest names the driver by file name (found in the system's folders): name this one
sed "s|\"library_path\": *\"[^\"]*\"|\"library_path\": \"$driver\"|" \
    "$(find "$folder/root" -name lvp_icd.json | head -n 1)" > "$folder/lvp_icd.json"
# every library the driver links must resolve, with every symbol it takes from them
if LD_LIBRARY_PATH="$libs" ldd -r "$driver" 2>&1 | grep -E "not found|undefined symbol"; then
  echo "mesa25-lavapipe: $driver misses the libraries above" >&2
  exit 1
fi
cat > "$folder/env.sh" <<EOF
# Mesa 25's lavapipe from $folder (scripts/mesa25-lavapipe.sh)
export VK_ICD_FILENAMES="$folder/lvp_icd.json"
export LD_LIBRARY_PATH="$libs\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
EOF
echo "mesa25-lavapipe: $(basename "$(ls "$folder"/debs/mesa-vulkan-drivers_*.deb)") in $folder (. $folder/env.sh)"
