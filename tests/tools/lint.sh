#!/usr/bin/env bash
# lint.sh: the lint stage. ansible-lint with the production profile on the whole collection,
# then ruff on plugins/ (rules in ruff.toml), then mypy --strict on plugins/ (mypy.ini). All
# three run; the stage fails when any does.
set -uo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
# mypy imports the collection as ansible_collections.gpufleet.vllm: from the collections root
# that `make collection-link` fills (the Makefile exports it as ANSIBLE_COLLECTIONS_PATH).
collections_root=${ANSIBLE_COLLECTIONS_PATH:-$repo/.cache/collections}
collections_root=${collections_root%%:*}
rc=0
ansible-lint --profile production || rc=1
echo "==== ruff check plugins/"
ruff check plugins/ || rc=1
echo "==== mypy --strict plugins/"
(cd "$collections_root" && mypy --config-file "$repo/mypy.ini" -p ansible_collections.gpufleet.vllm.plugins) || rc=1
exit "$rc"
