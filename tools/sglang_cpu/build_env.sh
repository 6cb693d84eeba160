#!/usr/bin/env bash
# Build SGLang 0.5.23's own virtual environment for CPU tests, cached outside the repository.
#
# SGLang pins torch 2.14.1 (a CUDA build, from PyPI, that runs on CPU) while asyncrl's .venv uses torch 2.13.0+cpu, so SGLang lives in its own venv, as SGLang users do.
# sglang is installed without its CUDA dependencies; the pure-Python ones it needs are listed in
# requirements-cpu.txt. sgl_kernel has no CPU build on PyPI: stub/ holds an import-only stand-in
# (put it on PYTHONPATH when starting the server; see server.py).
#
# pip prints "sglang 0.5.23 requires ..., which is not installed" for the CUDA-only dependencies left
# out on purpose; that report is expected. The build fails only if `import sglang.launch_server` does.
#
# Reruns reuse the cached venv: a stamp file records a hash of the pins below and of
# requirements-cpu.txt, so changing either rebuilds it. The cache check reads package metadata only (`import sglang` takes
# ~30 s). Measured here: 131-409 s from scratch (torch 2.14.1 and its CUDA libraries are downloaded
# from PyPI: the time depends on the network), 6.3 GB.
#
#   tools/sglang_cpu/build_env.sh            # prints the venv's python path on the last line
#   ASYNCRL_SGLANG_VENV=/path ...            # choose the cache location
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="${ASYNCRL_SGLANG_VENV:-$HOME/.cache/asyncrl/sglang-0.5.23-cpu}"
stamp="$venv/.asyncrl-complete"
py="$venv/bin/python"
torch_pins="torch==2.14.1 torchvision==0.29.1"
sglang_pin="sglang==0.5.23"
want="$( (echo "$torch_pins $sglang_pin"; cat "$here/requirements-cpu.txt") | sha256sum | cut -c1-16)"

cached_ok() {
  [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$py" - <<'EOF' >/dev/null 2>&1
import importlib.metadata as m
assert m.version("sglang") == "0.5.23" and m.version("torch").startswith("2.14.1")
EOF
}

if cached_ok; then
  echo "sglang env: cached at $venv" >&2
  echo "$py"
  exit 0
fi

if ! command -v python3.11 >/dev/null && ! python3 -c 'import sys; assert sys.version_info[:2] == (3, 11)'; then
  echo "sglang env: needs Python 3.11 (sglang 0.5.23 ships cp311-cp313 wheels; this script uses 3.11)" >&2
  exit 1
fi
base="$(command -v python3.11 || command -v python3)"

start=$(date +%s)
echo "sglang env: building at $venv (2-7 minutes, 6.3 GB)" >&2
if [ -e "$venv" ] && [ ! -f "$venv/pyvenv.cfg" ] && [ -n "$(ls -A "$venv" 2>/dev/null)" ]; then
  echo "sglang env: $venv exists and is not a venv; not deleting it (set ASYNCRL_SGLANG_VENV)" >&2
  exit 1
fi
rm -rf "$venv"
"$base" -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip
"$venv/bin/pip" install -q $torch_pins
"$venv/bin/pip" install -q --no-deps $sglang_pin
"$venv/bin/pip" install -q -r "$here/requirements-cpu.txt"
if ! PYTHONPATH="$here/stub" SGLANG_USE_CPU_ENGINE=1 "$py" -c "import sglang.launch_server" 2>"$venv/import-error.txt"; then
  echo "sglang env: built, but 'import sglang.launch_server' fails:" >&2
  tail -n 5 "$venv/import-error.txt" >&2
  exit 1
fi
echo "$want" >"$stamp"
echo "sglang env: ready in $(( $(date +%s) - start )) s" >&2
echo "$py"
