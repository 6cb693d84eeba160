#!/usr/bin/env bash
# Download the wheels the GPU check needs and the GPU host lacks (requirements.txt) into
# tools/gpu/wheels/ (git-ignored), for a host with no network: Python 3.12, x86_64, manylinux.
# Carry the folder with the repository (the run tool's `carry: ["tools/gpu/wheels"]`); check.sh
# installs from it offline (install.sh). Fails when the wheels exceed the budget, leaving room for
# the repository in what one GPU session may carry (64 MiB in all).
#
#   tools/gpu/bundle.sh                      # prints the total size on the last line
#   ASYNCRL_BUNDLE_BUDGET_MIB=48 ...         # the budget (MiB)
#   ASYNCRL_BUNDLE_PYTHON_VERSION=3.12 ...   # the host's Python (cp312 wheels)
#   ASYNCRL_BUNDLE_DIR=/elsewhere ...        # another folder (a proxy bundle for another Python)
#
# Reruns reuse what is already downloaded (pip skips a wheel that is there).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${ASYNCRL_BUNDLE_DIR:-$here/wheels}"
budget="${ASYNCRL_BUNDLE_BUDGET_MIB:-48}"
pyver="${ASYNCRL_BUNDLE_PYTHON_VERSION:-3.12}"
abi="cp${pyver/./}"
pip="${PIP:-python3 -m pip}"
mkdir -p "$out"
# every manylinux tag a glibc 2.28+ host accepts (pynng ships manylinux_2_26/2_28 only)
plats=()
for p in manylinux2014_x86_64 manylinux_2_17_x86_64 manylinux_2_24_x86_64 manylinux_2_26_x86_64 manylinux_2_28_x86_64; do
  plats+=(--platform "$p")
done
$pip download -q --only-binary=:all: --no-deps --python-version "$pyver" --implementation cp \
  --abi "$abi" --abi abi3 --abi none "${plats[@]}" -d "$out" -r "$here/requirements.txt"
# a wheel left from an older pin would be carried for nothing
want="$(grep -vE '^\s*(#|$)' "$here/requirements.txt" | sed 's/==.*//' | tr 'A-Z-' 'a-z_' | sort)"
for w in "$out"/*.whl; do
  name="$(basename "$w" | cut -d- -f1 | tr 'A-Z-' 'a-z_')"
  ver="$(basename "$w" | cut -d- -f2)"
  pin="$(grep -iE "^${name//_/[-_]}==" "$here/requirements.txt" | sed 's/.*==//')"
  if ! grep -qx "$name" <<<"$want" || [ "$ver" != "$pin" ]; then rm -f "$w"; fi
done
n=$(ls "$out"/*.whl | wc -l)
kib=$(du -ck "$out"/*.whl | tail -n 1 | cut -f1)
mib=$(( (kib + 1023) / 1024 ))
echo "bundle: $n wheels, $mib MiB in $out (budget $budget MiB)"
if [ "$mib" -gt "$budget" ]; then
  echo "bundle: over the budget of $budget MiB" >&2
  exit 1
fi
