#!/usr/bin/env bash
# The prepared GPU check (docs/gpu.md, "The GPU check"): one command for a session lent one GPU.
#
#   bash tools/gpu/check.sh RESULTS_DIR [--dry] [STEP ...]
#
# Runs the steps of tools/gpu/check.py in order, each in its own process under `timeout`, and
# appends one JSON record per step to RESULTS_DIR/check.jsonl (step, ok, rc, seconds, figures, the
# output's tail when it failed); a failed or timed-out step does not stop the others. Each step's
# full output is kept in RESULTS_DIR/logs/STEP.log. The whole run stays within ASYNCRL_CHECK_BUDGET_S
# (default 480 s): a step gets its own limit or what is left of the budget, whichever is less, and
# is skipped (recorded as such) under 20 s.
#
# Environment: with tools/gpu/wheels/ present (tools/gpu/bundle.sh), the wheels the host lacks are
# installed offline first into a folder on PYTHONPATH (install.sh; the host's torch stays), and the
# torch-version shim (tools/gpu/shim/) goes before it; that is the "install" record.
# ASYNCRL_CHECK_PYTHON names the interpreter (default python3). Models and run
# folders go to ASYNCRL_CHECK_WORK (default: a temporary folder), never to RESULTS_DIR: what is
# under RESULTS_DIR is what comes back.
#
# --dry: every step on CPU at tiny sizes (gloo): what the test tier runs (tests/test_gpu_check.py).
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
results="${1:?usage: check.sh RESULTS_DIR [--dry] [STEP ...]}"
shift
dry=""
steps=()
for a in "$@"; do
  if [ "$a" = "--dry" ]; then dry="--dry"; else steps+=("$a"); fi
done
[ ${#steps[@]} -eq 0 ] && steps=(env models nccl logprobs learner weights engine run lora)

declare -A limit=([env]=60 [models]=120 [nccl]=60 [logprobs]=90 [learner]=180 [weights]=120 [engine]=120 [run]=240 [lora]=120)
budget="${ASYNCRL_CHECK_BUDGET_S:-480}"
start=$(date +%s)
mkdir -p "$results/logs"
results="$(cd "$results" && pwd)"
work="${ASYNCRL_CHECK_WORK:-$(mktemp -d -t asyncrl-gpu-check.XXXXXX)}"
mkdir -p "$work"
py="${ASYNCRL_CHECK_PYTHON:-python3}"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export WANDB_MODE=disabled PYTHONUNBUFFERED=1

# An outcome recorded without a Python step (install, skip): the same record shape.
note() { # step ok seconds message
  "$py" - "$results/check.jsonl" "$@" <<'EOF' 2>/dev/null || echo "{\"step\": \"$1\", \"ok\": false}" >>"$results/check.jsonl"
import json, sys
path, step, ok, seconds, msg = sys.argv[1:6]
rec = {"step": step, "ok": ok == "1", "rc": 0 if ok == "1" else 1, "timed_out": False,
       "seconds": float(seconds), "figures": {"note": msg} if ok == "1" else {}, "error": "" if ok == "1" else msg}
open(path, "a").write(json.dumps(rec) + "\n")
EOF
  echo "[$([ "$2" = 1 ] && echo "ok  " || echo FAIL)] $1: $4"
}

if [ -z "$dry" ] && [ -d "$here/wheels" ]; then
  t0=$(date +%s)
  if out="$(PYTHON="$py" bash "$here/install.sh" "$work/site" 2>&1)"; then
    export PYTHONPATH="$here/shim:$work/site:$PYTHONPATH"
    note install 1 $(($(date +%s) - t0)) "$(echo "$out" | tail -n 2 | tr '\n' ' ')"
  else
    note install 0 $(($(date +%s) - t0)) "$(echo "$out" | tail -n 20)"
  fi
fi

echo "check: python $py, results $results, work $work, budget ${budget} s ${dry:+(dry)}"
for s in "${steps[@]}"; do
  left=$((budget - ($(date +%s) - start)))
  t=${limit[$s]:-120}
  [ "$left" -lt "$t" ] && t=$left
  if [ "$t" -lt 20 ]; then
    note "$s" 0 0 "skipped: ${left} s of the ${budget} s budget left"
    continue
  fi
  log="$results/logs/$s.log"
  t0=$EPOCHREALTIME
  timeout -k 10 "$t" "$py" "$here/check.py" "$s" "$work" $dry >"$log" 2>&1
  rc=$?
  secs=$(awk "BEGIN { print $EPOCHREALTIME - $t0 }")
  "$py" "$here/check.py" record "$results" "$s" "$rc" "$secs" "$log"
done
ok=$(grep -c '"ok": true' "$results/check.jsonl" || true)
total=$(wc -l <"$results/check.jsonl")
echo "check: $ok of $total records ok in $(($(date +%s) - start)) s; $results/check.jsonl"
