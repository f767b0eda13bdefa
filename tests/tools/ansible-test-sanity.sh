#!/usr/bin/env bash
# ansible-test-sanity.sh [EXTRA ansible-test sanity ARGS...]
# ansible-test-sanity.sh --write-get-pip   (only place the offline get-pip stand-in; print its path)
#
# Run `ansible-test sanity --python 3.11` on the collection, offline, with no
# tests/sanity/ignore-*.txt files.
#
# ansible-test must run from .../ansible_collections/<namespace>/<name>, so the
# tracked and untracked-but-not-ignored files of the working tree are copied into a
# fresh tree under $GPUFLEET_CACHE/ansible-test/ on every run (deleted files vanish).
#
# ansible-test bootstraps pip into each sanity virtual environment with a get-pip
# script it downloads from the internet. This script pre-places an offline stand-in
# at the cache path ansible-test checks first; the stand-in installs pip with
# ensurepip and then runs pip with the environment as it was before ensurepip
# (ensurepip sets PIP_CONFIG_FILE=/dev/null, which would lose the machine's pip
# configuration: indexes, find-links, constraints).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
CACHE=${GPUFLEET_CACHE:-$ROOT/.cache}
PYVER=${SANITY_PYTHON:-3.11}
NAMESPACE=gpufleet
NAME=vllm

die() { echo "ansible-test-sanity: $*" >&2; exit 2; }

command -v ansible-test >/dev/null || die "ansible-test not found on PATH (run 'make venv')"

# ---------------------------------------------------------------- offline get-pip
# write_get_pip: place the stand-in where ansible-test looks for its cached bootstrap
# script (~/.ansible/test/cache/get_pip_<pip version, dots as underscores>.py) and set
# GET_PIP to its path.
write_get_pip() {
    local at_py at_pkg pip_version
    # ansible-test's own interpreter: the one in its console script's shebang.
    at_py=$(head -n 1 "$(command -v ansible-test)" | sed -e 's/^#![[:space:]]*//' -e 's/[[:space:]].*//')
    at_pkg=$("$at_py" -c 'import os, ansible_test; print(os.path.dirname(ansible_test.__file__))') \
        || die "cannot import ansible_test with $at_py"
    pip_version=$(sed -n "s/^ *pip='\([0-9.]*\)',\$/\1/p" "$at_pkg/_internal/python_requirements.py" | head -n 1)
    [ -n "$pip_version" ] \
        || die "cannot find the pip version ansible-test bootstraps in $at_pkg/_internal/python_requirements.py"
    grep -q "get_pip_%s.py" "$at_pkg/_util/target/setup/requirements.py" \
        || die "ansible-test no longer caches its bootstrap script as get_pip_<version>.py: update this script"
    GET_PIP="$HOME/.ansible/test/cache/get_pip_${pip_version//./_}.py"
    mkdir -p "$(dirname "$GET_PIP")"
    cat > "$GET_PIP.tmp" <<'EOF'
"""Offline stand-in for get-pip.py used by ansible-test (written by ansible-test-sanity.sh).

Installs pip with ensurepip, then runs `pip install ARGS` with the environment as it
was before ensurepip, so the machine's pip configuration stays in force.
"""
import ensurepip
import os
import subprocess
import sys

ENV = dict(os.environ)
ensurepip.bootstrap(upgrade=True)
ARGS = [arg for arg in sys.argv[1:] if arg not in ("--no-setuptools", "--no-wheel")]
sys.exit(subprocess.call([sys.executable, "-m", "pip", "install", *ARGS], env=ENV))
EOF
    mv "$GET_PIP.tmp" "$GET_PIP"
}

if [ "${1:-}" = "--write-get-pip" ]; then
    write_get_pip
    echo "$GET_PIP"
    exit 0
fi

command -v "python$PYVER" >/dev/null || die "python$PYVER not found on PATH (set SANITY_PYTHON to another version)"
command -v git >/dev/null || die "git not found on PATH"

# Without the shellcheck binary the shellcheck sanity test only warns: install it.
if ! command -v shellcheck >/dev/null; then
    if [ -x "$ROOT/tests/tools/apt-deps.sh" ]; then
        "$ROOT/tests/tools/apt-deps.sh"
    fi
    if ! command -v shellcheck >/dev/null; then
        [ "$(id -u)" -eq 0 ] || die "shellcheck is missing and installing it needs root"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq
        apt-get install -y -qq --no-install-recommends shellcheck </dev/null
    fi
fi

cd "$ROOT"

# No ignore files: new code must be clean.
ignores=$(git ls-files -co --exclude-standard -- 'tests/sanity/ignore-*.txt' 2>/dev/null)
if [ -n "$ignores" ]; then
    die "sanity ignore files are not allowed, fix the findings instead: $(echo "$ignores" | tr '\n' ' ')"
fi

# ---------------------------------------------------------------- collection copy
# One run at a time per user: a second run would delete the copy under the first, and
# ansible-test shares its sanity virtual environments (~/.ansible/test/venv) between runs
# without locking them while it creates them.
lock="$HOME/.ansible/test/gpufleet-vllm-sanity.lock"
mkdir -p "$(dirname "$lock")"
exec 9>"$lock"
if ! flock -n 9; then
    echo "ansible-test-sanity: waiting for another sanity run to finish ($lock)"
    flock 9
fi
# ansible-test finds the collection from its own working directory; a collections path
# from the environment (make sets one for the unit tests) would shadow the copy.
unset PYTHONPATH ANSIBLE_COLLECTIONS_PATH ANSIBLE_COLLECTIONS_PATHS
write_get_pip
WORK="$CACHE/ansible-test/ansible_collections/$NAMESPACE/$NAME"
rm -rf "$WORK"
mkdir -p "$WORK"
# -z: file names with any characters; files listed but deleted in the tree are skipped.
git ls-files -co --exclude-standard -z | while IFS= read -r -d '' f; do
    if [ -e "$f" ] || [ -L "$f" ]; then
        printf '%s\0' "$f"
    fi
done | tar --null --no-recursion -T - -cf - | tar -xf - -C "$WORK"
# ansible-test lists content with git when it finds a .git directory above it; the
# copy is git-ignored by this repository, so it gets a repository of its own.
git -C "$WORK" init -q
nfiles=$(find "$WORK" -path "$WORK/.git" -prune -o -type f -print | wc -l)
echo "ansible-test-sanity: $nfiles files copied to $WORK"

# ---------------------------------------------------------------- run
cd "$WORK"
log=$(mktemp)
trap 'rm -f "$log"' EXIT
set +e
ansible-test sanity --python "$PYVER" --color no "$@" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
set -e

ran=$(grep -c '^Running sanity test "' "$log" || true)
skipped=$(grep -c 'Skipping sanity test "' "$log" || true)
failed=$(sed -n 's/^[A-Z]*: The \([0-9]*\) sanity test(s) listed below (out of [0-9]*) failed.*/\1/p' "$log" | tail -n 1)
failed=${failed:-0}
if [ "$rc" -ne 0 ] && [ "$failed" -eq 0 ]; then
    failed="?"
fi
echo "Sanity summary: $ran sanity tests run, $failed failed, $skipped skipped (ansible-test exit $rc)"
exit "$rc"
