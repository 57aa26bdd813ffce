#!/usr/bin/env bash
# Usage: scripts/fuzz_campaign.sh workers|dashboard|all
#
# A HypoFuzz campaign over tests/fuzz/targets.py (make fuzz, fuzz-worker,
# fuzz-dashboard). Every process uses the example database $KVCACHE_FUZZ_DB
# (a directory, or redis://HOST:PORT/DB), so workers on several machines that
# share it share their corpus and failures, and one dashboard shows them all.
#   workers    one HypoFuzz process per fuzz target ($FUZZ_WORKERS per target)
#   dashboard  the dashboard alone, on $FUZZ_HOST:$FUZZ_PORT
#   all        both (make fuzz)
# Runs until Ctrl-C, or for $FUZZ_SECONDS seconds when set; stops only the
# processes it started.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mode=${1:-all}
venv=.venv-fuzz  # make fuzz installs HypoFuzz there (scripts/bootstrap.sh fuzz)
hypothesis=$venv/bin/hypothesis
targets=(TestManagerMachine test_random_scheduler_matches_reference)
export HYPOTHESIS_PROFILE=fuzz PYTHONHASHSEED=${PYTHONHASHSEED:-0}
export KVCACHE_FUZZ_DB=${KVCACHE_FUZZ_DB:-$PWD/.hypothesis/fuzz-db}
pids=()

stop() {
    trap - INT TERM EXIT
    # Each HypoFuzz process leads its own process group (setsid): stopping the
    # group also stops the worker processes it forked.
    for pid in "${pids[@]}"; do kill -TERM -- "-$pid" 2>/dev/null; done
    wait 2>/dev/null
    if [ "$mode" != dashboard ]; then
        # HypoFuzz prints "Found a failing input for every test!" whenever it
        # stops; the database says whether it did: replay what it saved.
        local replay
        replay=$(KVCACHE_FUZZ_PHASES=explicit,reuse "$venv/bin/python" -m pytest -q \
            -p no:cacheprovider tests/fuzz/targets.py 2>&1)
        if [ $? -eq 0 ]; then
            echo "fuzz: stopped; no failing example saved in $KVCACHE_FUZZ_DB"
        else
            echo "$replay" | tail -n 60
            echo "fuzz: stopped; the failures above are saved in $KVCACHE_FUZZ_DB (replay:"
            echo "  HYPOTHESIS_PROFILE=fuzz KVCACHE_FUZZ_DB=$KVCACHE_FUZZ_DB \\"
            echo "  KVCACHE_FUZZ_PHASES=explicit,reuse $venv/bin/python -m pytest tests/fuzz/targets.py)"
        fi
    fi
}
trap stop INT TERM EXIT

if [ "$mode" = workers ] || [ "$mode" = all ]; then
    for target in "${targets[@]}"; do
        # One process per target: HypoFuzz's dashboard trips over reports when a
        # process switches targets (25.11.1), so each target keeps its own.
        setsid "$hypothesis" fuzz -n "${FUZZ_WORKERS:-1}" --no-dashboard -- \
            tests/fuzz/targets.py -k "$target" -p no:cacheprovider &
        pids+=($!)
    done
fi
if [ "$mode" = dashboard ] || [ "$mode" = all ]; then
    setsid "$hypothesis" fuzz --dashboard-only --host "${FUZZ_HOST:-localhost}" \
        --port "${FUZZ_PORT:-9999}" -- tests/fuzz/targets.py -p no:cacheprovider &
    pids+=($!)
    echo "fuzz: dashboard at http://${FUZZ_HOST:-localhost}:${FUZZ_PORT:-9999}/"
fi
echo "fuzz: example database $KVCACHE_FUZZ_DB; ${#pids[@]} processes; Ctrl-C stops them"
if [ -n "${FUZZ_SECONDS:-}" ]; then
    sleep "$FUZZ_SECONDS"
else
    wait
fi
