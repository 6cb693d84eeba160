#!/usr/bin/env bash
# Build TRL 1.16.0's own virtual environment for tools/bench/vs_trl.py, cached outside the repository.
#
# TRL is what the bench compares asyncrl with, so it lives in its own venv, as a TRL user's would:
# torch 2.13.0 (the CPU build, as in asyncrl's .venv) is installed first, then trl and the pins in
# trl_requirements.txt (transformers at asyncrl's version, so that both sides load and sample the
# model with the same code); the build fails if pip replaced torch.
#
# Reruns reuse the cached venv: a stamp file records a hash of the pins below and of
# trl_requirements.txt, so changing either rebuilds it. The cache check reads package metadata only.
#
#   tools/bench/trl_env.sh             # prints the venv's python path on the last line
#   ASYNCRL_TRL_VENV=/path ...         # choose the cache location
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="${ASYNCRL_TRL_VENV:-$HOME/.cache/asyncrl/trl-1.16.0-cpu}"
stamp="$venv/.asyncrl-complete"
py="$venv/bin/python"
torch_pin="torch==2.13.0"
want="$( (echo "$torch_pin"; cat "$here/trl_requirements.txt") | sha256sum | cut -c1-16)"

cached_ok() {
  [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$py" - <<'PY' >/dev/null 2>&1
import importlib.metadata as m
assert m.version("trl") == "1.16.0" and m.version("torch").startswith("2.13.0")
PY
}

if cached_ok; then
  echo "trl env: cached at $venv" >&2
  echo "$py"
  exit 0
fi

if ! python3 -c 'import sys; assert sys.version_info[:2] >= (3, 10)'; then
  echo "trl env: needs Python >= 3.10" >&2
  exit 1
fi
start=$(date +%s)
echo "trl env: building at $venv (a few minutes)" >&2
if [ -e "$venv" ] && [ ! -f "$venv/pyvenv.cfg" ] && [ -n "$(ls -A "$venv" 2>/dev/null)" ]; then
  echo "trl env: $venv exists and is not a venv; not deleting it (set ASYNCRL_TRL_VENV)" >&2
  exit 1
fi
rm -rf "$venv"
python3 -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip
"$venv/bin/pip" install -q "$torch_pin"
torch_before="$("$py" -c 'import torch; print(torch.__version__)')"
# torch is held at the version just installed: an unpinned resolve could pull a multi-GB CUDA build
"$venv/bin/pip" install -q -r "$here/trl_requirements.txt" "torch==$torch_before"
torch_after="$("$py" -c 'import torch; print(torch.__version__)')"
if [ "$torch_before" != "$torch_after" ]; then
  echo "trl env: pip replaced torch $torch_before with $torch_after" >&2
  exit 1
fi
if ! "$py" -c "import trl; from trl import GRPOConfig, GRPOTrainer" 2>"$venv/import-error.txt"; then
  echo "trl env: built, but 'from trl import GRPOTrainer' fails:" >&2
  tail -n 5 "$venv/import-error.txt" >&2
  exit 1
fi
echo "$want" >"$stamp"
echo "trl env: ready in $(( $(date +%s) - start )) s (torch $torch_after)" >&2
echo "$py"
