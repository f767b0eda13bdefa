#!/usr/bin/env bash
# run-integration.sh PYTHON [PYTEST ARGS...]: the integration stage.
#
# The modules run on GPUFLEET_TEST_WORKERS pytest-xdist workers (default 2), a whole module
# per worker (--dist loadfile) so that each module boots its fleet once. Most of a fleet
# test's time is spent waiting on guests, SSH and engine boots, so two modules side by side
# use the two cores a CI machine has. test_harness.py runs first and alone: it creates
# stray namespaces on purpose, and the harness refuses to boot any host while a stray one
# exists, so it would fail the other worker's start-ups. With GPUFLEET_HARNESS_TESTED=1 it
# is left out: `make test` runs it before this stage, as a stage of its own (`make harness`),
# since molecule's hosts boot beside this stage.
#
# The last line adds up both runs' pytest counts ("130 passed, 1 failed in 1200s").
set -uo pipefail

[ "$#" -ge 1 ] || { echo "usage: run-integration.sh PYTHON [PYTEST ARGS...]" >&2; exit 2; }
py=$1; shift
workers=${GPUFLEET_TEST_WORKERS:-2}
alone=tests/integration/test_harness.py
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT

start=$(date +%s)
rc_alone=0
if [ "${GPUFLEET_HARNESS_TESTED:-0}" != 1 ]; then
    "$py" -m pytest -q "$@" "$alone" 2>&1 | tee "$logs/alone.log"
    rc_alone=${PIPESTATUS[0]}
else
    : > "$logs/alone.log"
fi
# Each test's time also goes to a JUnit file, so that a run's per-module times can be added up.
"$py" -m pytest -q -n "$workers" --dist loadfile --no-loadscope-reorder --durations=25 \
    --junitxml="${GPUFLEET_CACHE:-.cache}/integration-junit.xml" "$@" --ignore="$alone" tests/integration 2>&1 \
    | tee "$logs/rest.log"
rc_rest=${PIPESTATUS[0]}
secs=$(( $(date +%s) - start ))

# Sum "N passed, N failed, ..." over the final line of each run (a run that printed none,
# e.g. one killed at collection, adds nothing and its exit status fails the stage).
"$py" - "$secs" "$logs/alone.log" "$logs/rest.log" <<'PY'
import re
import sys

words = ("failed", "passed", "skipped", "xfailed", "xpassed", "errors", "error", "deselected")
total: dict[str, int] = {}
final = re.compile(r"^=*\s*((?:\d+ \w+(?:, )?)+) in [\d.]+s")
for path in sys.argv[2:]:
    lines = [m.group(1) for m in map(final.match, open(path, encoding="utf-8", errors="replace")) if m]
    for count, word in re.findall(r"(\d+) (\w+)", lines[-1] if lines else ""):
        word = "errors" if word == "error" else word
        if word in words:
            total[word] = total.get(word, 0) + int(count)
parts = [f"{total[w]} {w}" for w in words if total.get(w)]
print(f"{', '.join(parts) or 'no tests ran'} in {sys.argv[1]}.00s")
PY

rc=0
[ "$rc_alone" -eq 0 ] || rc=$rc_alone
[ "$rc_rest" -eq 0 ] || rc=$rc_rest
exit "$rc"
