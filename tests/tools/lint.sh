#!/usr/bin/env bash
# lint.sh: the lint stage. ansible-lint with the production profile on the whole collection,
# then ruff on plugins/ (rules in ruff.toml). Both run; the stage fails when either does.
set -uo pipefail
rc=0
ansible-lint --profile production || rc=1
echo "==== ruff check plugins/"
ruff check plugins/ || rc=1
exit "$rc"
