#!/usr/bin/env bash
# What a session lent a GPU runs as its one device command (the device tool's `run`, timeout_s up to
# 540): the GPU check (check.sh, with the wheel bundle carried) into a folder, packed as ONE tarball
# under $OUT (the tool brings back at most 8 files from $OUT), with the records beside it.
#
#   bash tools/gpu/on_device.sh [STEP ...]        # OUT set by the device tool
#
# The tarball is rewritten every 15 s while the check runs, so a command cut by the tool's limit
# still brings back what the check had written (logs, records, the run folders' logs) until then.
# ASYNCRL_CHECK_BUDGET_S (default 480) bounds the check itself: keep it 45 s under timeout_s.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${OUT:?OUT: the folder the device tool brings back}"
res="$(mktemp -d -t asyncrl-check.XXXXXX)/check"
mkdir -p "$res"
pack() {
  tar czf "$out/.check.tar.gz" -C "$(dirname "$res")" check 2>/dev/null &&
    mv -f "$out/.check.tar.gz" "$out/check.tar.gz"
  cp -f "$res/check.jsonl" "$out/check.jsonl" 2>/dev/null
  return 0
}
bash "$here/check.sh" "$res" "$@" &
pid=$!
while kill -0 "$pid" 2>/dev/null; do
  for _ in $(seq 75); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
  pack
done
wait "$pid"
rc=$?
pack
echo "on_device: check.sh exited $rc; $out/check.tar.gz ($(du -h "$out/check.tar.gz" | cut -f1)), $out/check.jsonl"
exit "$rc"
