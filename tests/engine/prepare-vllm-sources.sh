#!/usr/bin/env bash
# Prepare the Python sources of every vLLM release the collection supports, for the
# oracle matrix and the per-release format checks (tests/integration/test_vllm_releases.py):
#   DEST/<version>/vllm/...   the .py files of the `vllm` wheel of that release
# The releases are the collection's own list (plugins/module_utils/_engine/_vllm_release.py,
# SUPPORTED_WHEELS). Only the wheel is fetched (no dependencies): its planning code is
# imported with the CPU engine's interpreter, which has torch and vLLM's other
# dependencies. Idempotent: a stamp per release skips what is already there; each release
# is unpacked in DEST/<version>.partial and renamed into place.
set -eEuo pipefail

main() {
    [ "$#" -eq 1 ] || { echo "usage: $0 DEST" >&2; exit 2; }
    DEST="$(realpath -m "$1")"
    ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
    PY="${PY:-python3}"
    trap 'echo "prepare-vllm-sources: FAILED (exit $?): $BASH_COMMAND" >&2' ERR
    # SUPPORTED_WHEELS, read from the module's source (module_utils has no command line)
    mapfile -t versions < <("$PY" - "$ROOT/plugins/module_utils/_engine/_vllm_release.py" <<'PYEOF'
import ast
import sys

tree = ast.parse(open(sys.argv[1], encoding="utf-8").read())
for node in tree.body:
    if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == "SUPPORTED_WHEELS":
        print("\n".join(ast.literal_eval(node.value)))
PYEOF
)
    [ "${#versions[@]}" -gt 0 ] || { echo "prepare-vllm-sources: no release listed" >&2; exit 1; }
    mkdir -p "$DEST"
    for version in "${versions[@]}"; do
        if [ -f "$DEST/$version/.stamp" ] && [ -f "$DEST/$version/vllm/__init__.py" ]; then
            echo "prepare-vllm-sources: vllm $version is up to date"
            continue
        fi
        start=$(date +%s)
        work="$DEST/$version.partial"
        rm -rf "$work" "${DEST:?}/$version"
        mkdir -p "$work/wheel"
        "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$work/wheel" "vllm==$version"
        wheel="$(find "$work/wheel" -name "vllm-$version-*.whl" | head -n 1)"
        [ -n "$wheel" ] || { echo "prepare-vllm-sources: no wheel of vllm $version" >&2; exit 1; }
        # only the Python sources: the compiled kernels are not needed to plan
        "$PY" - "$wheel" "$work" <<'PYEOF'
import sys
import zipfile

wheel, dest = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as archive:
    names = [n for n in archive.namelist() if n.startswith("vllm/") and n.endswith(".py")]
    archive.extractall(dest, names)
print(f"prepare-vllm-sources: {len(names)} files from {wheel.rsplit('/', 1)[-1]}")
PYEOF
        rm -rf "$work/wheel"
        echo "$version" > "$work/.stamp"
        mv "$work" "$DEST/$version"
        echo "prepare-vllm-sources: vllm $version ready in $(( $(date +%s) - start )) s"
    done
}

main "$@"
