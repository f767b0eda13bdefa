#!/usr/bin/env bash
# apt-deps.sh: install the Debian/Ubuntu packages every test stage needs.
# Idempotent: asks dpkg first and runs `apt-get update` only when something is missing.
set -euo pipefail

PACKAGES=(
    systemd-container   # systemd-nspawn: the test hosts
    debootstrap         # builds the test hosts' root file system
    debian-archive-keyring  # verifies the Debian archive debootstrap downloads (Ubuntu lacks it)
    iproute2            # ip netns / veth for the test hosts' networks
    openssh-client      # Ansible reaches the test hosts over SSH
    shellcheck          # ansible-test sanity lints shell scripts with it
    gcc                 # builds the fake NVML library
    make
    rsync
    python3-venv        # the development and engine virtual environments
    prometheus          # promtool (the example alert rules) and the server test_prometheus.py starts on loopback (never the service)
    faketime            # libfaketime: a controller whose clock is off the hosts' (the audit's clock-skew test)
)

missing=()
for pkg in "${PACKAGES[@]}"; do
    status=$(dpkg-query -W -f='${db:Status-Status}' "$pkg" 2>/dev/null || true)
    if [ "$status" != "installed" ]; then
        missing+=("$pkg")
    fi
done

if [ "${#missing[@]}" -eq 0 ]; then
    echo "apt-deps: all ${#PACKAGES[@]} packages already installed"
    exit 0
fi

if [ "$(id -u)" -ne 0 ]; then
    echo "apt-deps: missing packages: ${missing[*]} (run as root to install them)" >&2
    exit 1
fi

echo "apt-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
# The prometheus package would start (and enable) a Prometheus server: only promtool and the binary
# (test_prometheus.py starts its own server on loopback) are
# wanted, so no service is started while these packages are installed.
policy=/usr/sbin/policy-rc.d
if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy"
    chmod 0755 "$policy"
    trap 'rm -f "$policy"' EXIT
fi
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}"
if [[ " ${missing[*]} " == *" prometheus "* ]] && command -v systemctl >/dev/null; then
    systemctl disable --now prometheus.service >/dev/null 2>&1 || true
fi
