#!/usr/bin/env bash
# ensure-python.sh [PYTHON]: make sure PYTHON (default python3) exists and can create a
# virtual environment with pip. Debian and Ubuntu ship the venv/ensurepip modules in a
# separate package (python3-venv); as root this installs what is missing with apt-get.
set -euo pipefail

py=${1:-python3}

usable() {
    command -v "$py" >/dev/null 2>&1 && "$py" -c 'import ensurepip, venv' >/dev/null 2>&1
}

usable && exit 0

if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "ensure-python: '$py' is missing or cannot create virtual environments (no ensurepip);" \
         "install python3 and python3-venv (as root: apt-get install python3 python3-venv)" >&2
    exit 1
fi

export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
pkgs=(python3 python3-venv)
if command -v "$py" >/dev/null 2>&1; then
    # Ubuntu splits venv per minor version (python3.X-venv); python3-venv depends on the default one.
    ver=$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    if apt-cache show "python$ver-venv" >/dev/null 2>&1; then
        pkgs+=("python$ver-venv")
    fi
fi
echo "ensure-python: installing ${pkgs[*]}"
apt-get install -y -qq --no-install-recommends "${pkgs[@]}" </dev/null
usable || { echo "ensure-python: '$py' still cannot create virtual environments" >&2; exit 1; }
