#!/usr/bin/env bash
# The prepared GPU check (docs/gpu.md, "The GPU check"): one command for a session lent one GPU.
#
#   bash tools/gpu/check.sh RESULTS_DIR [--dry] [STEP[:SECONDS] ...]
#
# Runs the steps of tools/gpu/check.py in order (the named ones, else check.py's STEPS; flex only
# when named), each in its own process under `timeout`, and appends one JSON record per step to
# RESULTS_DIR/check.jsonl (step, ok, rc, seconds, figures, the output's tail when it failed); a
# failed or timed-out step does not stop the others. Before the first step it prints the plan, each
# step's expected seconds and limit (check.py's PLAN; also RESULTS_DIR/plan.json). Each step's full
# output is kept in RESULTS_DIR/logs/STEP.log. The whole run stays within ASYNCRL_CHECK_BUDGET_S
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
#
# So that every failure explains itself: each step's output (and its children's) streams into its
# log as it runs, with timestamped phases and a figures line after each (a cut step's record holds
# what it reached); the limits nest (a step's children end before the step's limit, `asyncrl run`
# inside them, its stop grace included); at a limit every process of the step gets SIGUSR1 first
# (asyncrl's processes and check.py dump their stacks into their logs), then SIGTERM, then
# SIGKILL, 5 s apart; whatever a step left running is killed before the next (every process the
# check starts carries ASYNCRL_CHECK_TAG); the run folders' logs and summaries are copied into
# RESULTS/work/ after each step, whatever its outcome; the GPU's compute processes are listed
# before and after each step; one inductor cache serves all steps; env always runs first.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
results="${1:?usage: check.sh RESULTS_DIR [--dry] [STEP[:SECONDS] ...]}"
shift
dry=""
steps=()
# STEP:SECONDS names a step with a limit of its own, in place of the plan's (still cut to what is
# left of the budget): a step rerun in what is left of a window, or a test's step whose limit must
# not depend on how long the steps before it took
declare -A named_limit=()
for a in "$@"; do
  if [ "$a" = "--dry" ]; then
    dry="--dry"
  else
    steps+=("${a%%:*}")
    [[ "$a" == *:* ]] && named_limit[${a%%:*}]=${a#*:}
  fi
done
budget="${ASYNCRL_CHECK_BUDGET_S:-480}"
# each step's limit times this (an integer): a --dry check on a loaded 2-core CPU runs its steps
# several times slower than the GPU host does (the test tier sets 3)
scale="${ASYNCRL_CHECK_LIMIT_SCALE:-1}"
start=$(date +%s)
mkdir -p "$results/logs"
results="$(cd "$results" && pwd)"
work="${ASYNCRL_CHECK_WORK:-$(mktemp -d -t asyncrl-gpu-check.XXXXXX)}"
mkdir -p "$work"
py="${ASYNCRL_CHECK_PYTHON:-python3}"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export WANDB_MODE=disabled PYTHONUNBUFFERED=1
export TORCHINDUCTOR_CACHE_DIR="$work/inductor" TRITON_CACHE_DIR="$work/triton"
export ASYNCRL_CHECK_TAG="check-$$-$start"

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

# The GPU's compute processes (what a step left on the device shows here).
gpu_apps() { # when
  echo "--- nvidia-smi compute apps $1:"
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader 2>&1
  else
    echo "(no nvidia-smi)"
  fi
}

# A signal to every process of this check but this shell (they carry ASYNCRL_CHECK_TAG), in any
# process group: `asyncrl run` puts its children in groups of their own.
signal_tagged() { # SIG
  for d in /proc/[0-9]*; do
    p=${d#/proc/}
    [ "$p" = "$$" ] && continue
    if grep -qzx "ASYNCRL_CHECK_TAG=$ASYNCRL_CHECK_TAG" "$d/environ" 2>/dev/null; then
      kill -"$1" "$p" 2>/dev/null
    fi
  done
}

# The run folders' logs, summaries and metrics, and any other log a step wrote under the work
# folder, into RESULTS/work/ (the work folder does not come back); the models stay.
keep_run_files() { # step
  (cd "$work" && find . -newer .step-start -type f \( -name '*.log' -o -name '*.json' \
    -o -name 'metrics.jsonl' -o -name 'profile_*.txt' \) -size -20M -not -path './inductor/*' \
    -not -path './triton/*' -not -name 'tokenizer*.json' -not -name '*config.json' -print0 |
    xargs -0 -r cp --parents -t "$results/work" 2>/dev/null)
}
mkdir -p "$results/work"

echo "check: python $py, results $results, work $work, budget ${budget} s ${dry:+(dry)}"
# the plan (env first, whatever the order asked; limits times the scale), printed before any step
declare -A limit=()
order=()
if "$py" "$here/check.py" plan "$results" "$budget" "$scale" ${steps[@]+"${steps[@]}"}; then
  while read -r s t; do order+=("$s"); limit[$s]=$t; done <"$results/.plan"
  rm -f "$results/.plan"
  for s in "${!named_limit[@]}"; do
    limit[$s]=${named_limit[$s]}
    echo "check: $s's limit ${named_limit[$s]} s, as named"
  done
else
  echo "check: no plan from check.py; the steps asked, at 120 s each"
  order=(env)
  for s in ${steps[@]+"${steps[@]}"}; do [ "$s" != env ] && order+=("$s"); done
fi
if [ -z "$dry" ] && [ -d "$here/wheels" ]; then
  t0=$(date +%s)
  if out="$(PYTHON="$py" bash "$here/install.sh" "$work/site" 2>&1)"; then
    export PYTHONPATH="$here/shim:$work/site:$PYTHONPATH"
    note install 1 $(($(date +%s) - t0)) "$(echo "$out" | tail -n 2 | tr '\n' ' ')"
  else
    note install 0 $(($(date +%s) - t0)) "$(echo "$out" | tail -n 20)"
  fi
fi

for s in "${order[@]}"; do
  left=$((budget - ($(date +%s) - start)))
  t=${limit[$s]:-$((120 * scale))}
  [ "$left" -lt "$t" ] && t=$left
  if [ "$t" -lt 20 ]; then
    note "$s" 0 0 "skipped: ${left} s of the ${budget} s budget left"
    continue
  fi
  log="$results/logs/$s.log"
  { echo "=== $s: limit $t s, $(date -u +%FT%TZ)"; gpu_apps before; } >"$log"
  t0=$EPOCHREALTIME
  touch "$work/.step-start"
  ASYNCRL_CHECK_LIMIT_S=$t setsid "$py" "$here/check.py" "$s" "$work" $dry >>"$log" 2>&1 &
  pid=$!
  end=$((SECONDS + t))
  while kill -0 "$pid" 2>/dev/null && [ $SECONDS -lt $end ]; do sleep 0.2; done
  if kill -0 "$pid" 2>/dev/null; then
    for sig in USR1 TERM KILL; do
      echo "--- check.sh: $s past its limit of $t s: SIG$sig to its processes ---" >>"$log"
      signal_tagged "$sig"
      for _ in $(seq 25); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    done
    wait "$pid" 2>/dev/null
    rc=124
  else
    wait "$pid"
    rc=$?
  fi
  secs=$(awk "BEGIN { print $EPOCHREALTIME - $t0 }")
  { gpu_apps after; "$py" "$here/check.py" reap "$ASYNCRL_CHECK_TAG"; } >>"$log" 2>&1
  keep_run_files "$s"
  "$py" "$here/check.py" record "$results" "$s" "$rc" "$secs" "$log"
done
ok=$(grep -c '"ok": true' "$results/check.jsonl" || true)
total=$(wc -l <"$results/check.jsonl")
echo "check: $ok of $total records ok in $(($(date +%s) - start)) s; $results/check.jsonl"
