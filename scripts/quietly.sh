#!/usr/bin/env bash
# Usage: scripts/quietly.sh LOG -- COMMAND...
# Runs COMMAND with its output appended to LOG (pip's index warnings stay out of
# the console); on failure prints the log's tail and exits with COMMAND's status.
set -uo pipefail
log=$1
shift
[ "${1:-}" = "--" ] && shift
mkdir -p "$(dirname "$log")"
"$@" >>"$log" 2>&1
rc=$?
if [ "$rc" -ne 0 ]; then
    tail -n 40 "$log"
    echo "failed (exit $rc): $*  (full log: $log)"
fi
exit "$rc"
