#!/usr/bin/env bash
# Install the bundled wheels (tools/gpu/bundle.sh) offline into TARGET, for PYTHONPATH: only those
# whose distribution the host's Python lacks or holds at an older version than the pin, so the
# host's torch (and anything newer it has) is what runs. A target folder, not a venv: a host Python
# may come without ensurepip, and folders on PYTHONPATH come before site-packages, so a bundled
# transformers 5 shadows a host's 4.x.
#
#   tools/gpu/install.sh TARGET      # last line: what was installed and what the host kept
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
target="${1:?usage: install.sh TARGET}"
py="${PYTHON:-python3}"
mkdir -p "$target"
mapfile -t pick < <("$py" - "${ASYNCRL_BUNDLE_DIR:-$here/wheels}" <<'PY'
import importlib.metadata as md, pathlib, sys
from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename
from pip._vendor.packaging.version import Version

kept = []
for w in sorted(pathlib.Path(sys.argv[1]).glob("*.whl")):
    name, ver, _, _ = parse_wheel_filename(w.name)
    try:
        have = Version(md.version(name))
    except md.PackageNotFoundError:
        have = None
    if have is None or have < ver:
        print(w)
    else:
        kept.append(f"{canonicalize_name(name)} {have}")
print("KEPT " + ", ".join(kept), file=sys.stderr)
PY
)
if [ ${#pick[@]} -gt 0 ]; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --target "$target" "${pick[@]}"
fi
echo "installed ${#pick[@]} wheels into $target"
