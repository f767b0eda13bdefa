#!/usr/bin/env bash
# run-stage.sh NAME CMD...: run one `make test` stage, record its result line for the summary.
set -uo pipefail
stage=$1; shift
log="${GPUFLEET_CACHE:-.cache}/stage-$stage.log"
mkdir -p "$(dirname "$log")"
echo "==== stage $stage: $*"
start=$(date +%s)
"$@" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
secs=$(( $(date +%s) - start ))
# The last pytest/ansible-test/ansible-lint/molecule summary line carries the counts.
summary=$(grep -E '([0-9]+ (passed|failed|error|skipped))|(Running sanity test)|(Passed: )|(Failed: )|(violation)|(scenario)' "$log" | tail -n 1)
if [ "$rc" -ne 0 ]; then
    echo "FAILED stage $stage (exit $rc) after ${secs}s: $*" >&2
    printf '%-12s FAILED  %4ss  %s\n' "$stage" "$secs" "$summary" >> "${GPUFLEET_CACHE:-.cache}/stages.txt"
    exit "$rc"
fi
printf '%-12s ok      %4ss  %s\n' "$stage" "$secs" "$summary" >> "${GPUFLEET_CACHE:-.cache}/stages.txt"
