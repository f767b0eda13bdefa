#!/usr/bin/env bash
# run-stage.sh NAME CMD...: run one `make test` stage and record its result line
# (stage, ok/FAILED, seconds, the tool's own counts) in $GPUFLEET_CACHE/stages.txt.
#
# The counts come from each tool's final summary:
#   pytest        "12 passed, 1 skipped in 3.40s"
#   ansible-test  "Sanity summary: 24 sanity tests run, 0 failed, 0 skipped" (ansible-test-sanity.sh)
#   ansible-lint  "Passed: 0 failure(s), 0 warning(s) in 40 files processed of 52 encountered.",
#                 then ruff's "All checks passed!" and mypy's "Success: no issues found in 47 source files"
#                 (tests/tools/lint.sh)
#   molecule      "Molecule executed 2 scenarios (2 successful)"
set -uo pipefail

[ "$#" -ge 2 ] || { echo "usage: run-stage.sh NAME CMD..." >&2; exit 2; }
stage=$1; shift
cache=${GPUFLEET_CACHE:-.cache}
log="$cache/stage-$stage.log"
mkdir -p "$cache"
# Wide, colourless output so that summary lines are not wrapped or escaped.
export COLUMNS=${COLUMNS:-200} NO_COLOR=1 PY_COLORS=0 ANSIBLE_NOCOLOR=1

# Every process the stage starts inherits this token; whatever still carries it once the
# stage's command has exited was left behind (tests/tools/leftovers.py lists, ends and fails it).
GPUFLEET_STAGE_TOKEN="$stage-$$-$(date +%s%N)"
export GPUFLEET_STAGE_TOKEN

echo "==== stage $stage: $*"
start=$(date +%s)
"$@" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
# (run without the token, and not in a pipeline whose other end would carry it)
leftover_out=$(env -u GPUFLEET_STAGE_TOKEN python3 "$(dirname "$0")/leftovers.py" "$GPUFLEET_STAGE_TOKEN" 2>&1)
leftover_rc=$?
[ -z "$leftover_out" ] || printf '%s\n' "$leftover_out" | tee -a "$log" >&2
if [ "$leftover_rc" -ne 0 ]; then
    echo "FAILED stage $stage: it left processes running (listed above)" >&2
    [ "$rc" -ne 0 ] || rc=1
fi
secs=$(( $(date +%s) - start ))

# summary_of TOOL LOGFILE: print the tool's count line (empty when it printed none).
summary_of() {
    local clean
    clean=$(sed -e 's/\x1b\[[0-9;]*[A-Za-z]//g' "$2")
    case $1 in
        pytest)
            # Final line: "[=====] 3 failed, 10 passed, 1 skipped in 2.10s [=====]" or "no tests ran in 0.01s".
            grep -E '(^|[= ])([0-9]+ (passed|failed|errors?|skipped|xfailed|xpassed|deselected|warnings?)(, )?)+ in [0-9.]+s|no tests ran' <<<"$clean" \
                | tail -n 1 | sed -E 's/^=+ //; s/ =+$//'
            ;;
        sanity)
            grep -E '^Sanity summary: ' <<<"$clean" | tail -n 1 | sed -E 's/^Sanity summary: //'
            ;;
        lint)
            # ansible-lint's line, then ruff's ("All checks passed!" or "Found 3 errors.") and mypy's
            # ("Success: no issues found in 47 source files" or "Found 2 errors in 1 file (checked 47 source files)")
            local ansible_lint ruff mypy
            ansible_lint=$(grep -E '^(Passed|Failed): [0-9]+ failure' <<<"$clean" | tail -n 1 | sed -E "s/ Profile '.*//")
            ruff=$(grep -E '^(All checks passed!|Found [0-9]+ errors?\.)' <<<"$clean" | tail -n 1)
            mypy=$(grep -E '^(Success: no issues found in [0-9]+ source files?|Found [0-9]+ errors? in [0-9]+ files? \()' <<<"$clean" | tail -n 1)
            [ -z "$ansible_lint" ] || echo "$ansible_lint${ruff:+; ruff: $ruff}${mypy:+; mypy: $mypy}"
            ;;
        molecule)
            grep -Eo 'Molecule executed [0-9]+ scenarios? \([^)]*\)' <<<"$clean" | tail -n 1
            ;;
    esac
}

case $stage in
    units|harness|readme|integration|real-engine|bench) tool=pytest ;;
    *) tool=$stage ;;
esac
summary=$(summary_of "$tool" "$log")
[ -n "$summary" ] || summary="(no $tool summary line found; see $log)"
[ "$leftover_rc" -eq 0 ] || summary="$summary; left processes running"

# One line per stage: a rerun of a stage replaces its previous line.
stages="$cache/stages.txt"
if [ -f "$stages" ]; then
    grep -v -E "^$stage " "$stages" > "$stages.tmp" || true
    mv "$stages.tmp" "$stages"
fi

if [ "$rc" -ne 0 ]; then
    echo "FAILED stage $stage (exit $rc) after ${secs}s: $*" >&2
    printf '%-12s FAILED  %4ss  %s\n' "$stage" "$secs" "$summary" >> "$stages"
    exit "$rc"
fi
printf '%-12s ok      %4ss  %s\n' "$stage" "$secs" "$summary" >> "$stages"
