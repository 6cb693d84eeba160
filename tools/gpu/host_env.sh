#!/usr/bin/env bash
# The GPU check's dry run in an environment like the lent GPU host's (docs/gpu.md, "Before GPU time:
# the host-like environment"): what breaks there for want of a torch API should break here first,
# on CPU, before any GPU time is spent on it.
#
#   bash tools/gpu/host_env.sh [RESULTS_DIR]      # default RESULTS_DIR: a new temporary folder
#
# The host has Python 3.12, torch 2.11.0 (CUDA build), triton, numpy, httpx, msgpack, rich,
# pyarrow, pytest and hypothesis; check.sh installs the rest from the wheel bundle, offline, into a
# folder on PYTHONPATH behind the torch shim. This script builds the same here:
#   1. a venv of Python 3.12 with torch==2.11.0 from PyPI (the CUDA build, which runs on CPU; its
#      nvidia-* wheels make it several GB) and the host's other packages, cached in
#      ASYNCRL_HOST_ENV_DIR (default ~/.cache/asyncrl/gpu-host-env) and rebuilt only when the pins
#      below change;
#   2. the bundle for cp312 (bundle.sh: reruns download only what changed) and, fresh each time,
#      install.sh into a site folder: exactly what check.sh does on the host, which --dry skips;
#   3. check.sh RESULTS_DIR/<attention> --dry with that venv's python and PYTHONPATH=shim:site:repo
#      (check.sh puts the repository first as well), once per attention that runs on CPU
#      (ASYNCRL_CHECK_ATTENTION=sdpa, then flex), then flex_probe.py: TorchTitan's flex path
#      (block mask, compiled flex_attention) forward on CPU, against the per-document SDPA.
# flex_attention has no backward on CPU (torch refuses it; asyncrl's model build refuses
# model.attention=flex on CPU for that reason), so in the flex pass the steps that train (learner,
# run, lora) fail with that refusal: the summary names them as such, and the probe is what runs
# TorchTitan's flex code here. Exit status 0 when the sdpa pass is all ok, the probe is ok and the
# flex pass fails nowhere else; RESULTS_DIR/host_env.json holds the times and each step's outcome.
#
#   ASYNCRL_HOST_PYTHON=/path/python3.12 ...   # the base interpreter (default: a Python 3.12 found
#                                              # on PATH or under pyenv; python3 with a warning)
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
cache="${ASYNCRL_HOST_ENV_DIR:-$HOME/.cache/asyncrl/gpu-host-env}"
results="${1:-$(mktemp -d -t asyncrl-host-env.XXXXXX)}"
venv="$cache/venv"
py="$venv/bin/python"
torch_pin="torch==2.11.0"
host_pkgs="numpy httpx msgpack rich pyarrow pytest hypothesis"
backends=(sdpa flex)
die() { echo "host env: error: $*" >&2; exit 2; }
now() { echo "$EPOCHREALTIME"; }
since() { awk "BEGIN { printf \"%.1f\", $EPOCHREALTIME - $1 }"; }

base_python() {
  if [ -n "${ASYNCRL_HOST_PYTHON:-}" ]; then
    "$ASYNCRL_HOST_PYTHON" -c '' 2>/dev/null || die "ASYNCRL_HOST_PYTHON=$ASYNCRL_HOST_PYTHON does not run"
    echo "$ASYNCRL_HOST_PYTHON"
    return
  fi
  # pyenv's shim for python3.12 exists but fails unless 3.12 is selected: try the version folders too
  local c
  for c in python3.12 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12; do
    if "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
      echo "$c"
      return
    fi
  done
  echo "host env: warning: no Python 3.12 found; using python3 ($(python3 -V 2>&1)), unlike the host" >&2
  echo python3
}

[ $# -le 1 ] || die "usage: host_env.sh [RESULTS_DIR]"
mkdir -p "$results" "$cache" || die "cannot create $results or $cache"
results="$(cd "$results" && pwd)"
t_all=$(now)

# ---- 1. the venv (cached) ----
base="$(base_python)" || exit 2
pyver="$("$base" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
want="$(echo "$pyver $torch_pin $host_pkgs" | sha256sum | cut -c1-16)"
stamp="$venv/.asyncrl-host-env"
t0=$(now)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$py" -c 'import torch' 2>/dev/null; then
  built=cached
else
  built=built
  echo "host env: building $venv (Python $pyver, $torch_pin: the CUDA build's wheels, several GB)" >&2
  if [ -e "$venv" ] && [ ! -f "$venv/pyvenv.cfg" ] && [ -n "$(ls -A "$venv" 2>/dev/null)" ]; then
    die "$venv exists and is not a venv; not deleting it (set ASYNCRL_HOST_ENV_DIR)"
  fi
  rm -rf "$venv"
  "$base" -m venv "$venv" || die "python $pyver cannot make a venv"
  # shellcheck disable=SC2086 # host_pkgs is a list of names
  "$venv/bin/pip" install -q "$torch_pin" $host_pkgs || die "pip install $torch_pin $host_pkgs failed"
  echo "$want" >"$stamp"
fi
venv_s=$(since "$t0")
torch_ver="$("$py" -c 'import torch; print(torch.__version__)')"
echo "host env: venv $built in $venv_s s: Python $("$py" -V 2>&1 | cut -d' ' -f2), torch $torch_ver" >&2

# ---- 2. the bundle, installed as check.sh installs it on the host ----
t0=$(now)
ASYNCRL_BUNDLE_DIR="$cache/bundle" ASYNCRL_BUNDLE_PYTHON_VERSION="$pyver" bash "$here/bundle.sh" >&2 ||
  die "bundle.sh failed (output above)"
bundle_s=$(since "$t0")
t0=$(now)
rm -rf "$cache/site"
installed="$(ASYNCRL_BUNDLE_DIR="$cache/bundle" PYTHON="$py" bash "$here/install.sh" "$cache/site" 2>&1)" ||
  die "install.sh failed: $(echo "$installed" | tail -n 3)"
install_s=$(since "$t0")
echo "$installed" | tail -n 2 >&2

# ---- 3. the dry check, per attention, and the flex probe ----
# what check.sh sets on the host after its install step; user site-packages are not the host's
export PYTHONPATH="$here/shim:$cache/site:$root" PYTHONNOUSERSITE=1
# torch 2.11's compiled code apart from other torch versions' (the default is shared, in /tmp)
export TORCHINDUCTOR_CACHE_DIR="$cache/inductor"
declare -A pass_s
for b in "${backends[@]}"; do
  rm -rf "${results:?}/$b" "${cache:?}/work/$b"
  t0=$(now)
  echo "host env: check.sh --dry, ASYNCRL_CHECK_ATTENTION=$b" >&2
  ASYNCRL_CHECK_ATTENTION="$b" ASYNCRL_CHECK_PYTHON="$py" ASYNCRL_CHECK_WORK="$cache/work/$b" \
    bash "$here/check.sh" "$results/$b" --dry >&2
  pass_s[$b]=$(since "$t0")
done
t0=$(now)
echo "host env: flex_probe.py" >&2
timeout -k 10 600 "$py" "$here/flex_probe.py" "$cache/work/probe" >"$results/flex_probe.log" 2>&1
probe_rc=$?
probe_s=$(since "$t0")

# ---- the summary ----
"$py" - "$results" "$probe_rc" <<EOF
import json, sys
from pathlib import Path

results, probe_rc = Path(sys.argv[1]), int(sys.argv[2])
REFUSED = "cannot train on CPU"  # asyncrl's refusal of flex on CPU (asyncrl/learner/model_spec.py)
out = {
    "python": "$pyver", "torch": "$torch_ver", "venv": "$built",
    "seconds": {"venv": $venv_s, "bundle": $bundle_s, "install": $install_s,
                "sdpa": ${pass_s[sdpa]}, "flex": ${pass_s[flex]}, "flex_probe": $probe_s},
    "passes": {},
}
ok = True
for b in ("sdpa", "flex"):
    recs = [json.loads(x) for x in (results / b / "check.jsonl").read_text().splitlines()]
    rows = {}
    for r in recs:
        log = results / b / "logs" / f"{r['step']}.log"
        # the whole log: the refusal may lie before the record's 2,000-character tail
        text = log.read_text(errors="replace") if log.exists() else r.get("error") or ""
        lines = [x.strip() for x in text.splitlines() if x.strip()]
        refused = [x for x in lines if REFUSED in x]
        errors = [x for x in lines if "Error" in x or "error:" in x]
        if r["ok"]:
            rows[r["step"]] = "ok"
        elif b == "flex" and refused:
            rows[r["step"]] = "refused: " + refused[-1][-200:]
        else:
            rows[r["step"]] = "FAIL: " + ((errors or lines or ["(no output)"])[-1])[-200:]
            ok = False
    out["passes"][b] = rows
    print(f"--- {b}: {sum(v == 'ok' for v in rows.values())} of {len(rows)} steps ok")
    for step, v in rows.items():
        print(f"  {step:<9} {v}")
probe_lines = (results / "flex_probe.log").read_text().splitlines()
probe = next((json.loads(x) for x in reversed(probe_lines) if x.startswith("{")), {})
out["flex_probe"] = probe
ok = ok and probe_rc == 0 and probe.get("ok") is True
print("--- flex probe (TorchTitan's flex path on CPU, forward):",
      "ok" if probe.get("ok") else "FAIL", json.dumps(probe)[:600])
if probe_rc and not probe:
    print("\n".join(probe_lines[-5:]))
out["ok"] = ok
(results / "host_env.json").write_text(json.dumps(out, indent=1) + "\n")
print(f"host env: {'ok' if ok else 'FAILED'}; seconds {out['seconds']}; {results}/host_env.json")
sys.exit(0 if ok else 1)
EOF
rc=$?
echo "host env: done in $(since "$t_all") s" >&2
exit $rc
