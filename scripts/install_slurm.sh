#!/usr/bin/env bash
# Install the SLURM and munge packages that scripts/slurm_cluster.sh needs (Debian/Ubuntu, as root).
#
# Idempotent and quiet: exits at once when all are installed, and runs `apt-get update` only when
# something is missing. Installing starts no daemon.
set -euo pipefail

packages=(slurmctld slurmd slurm-client munge)

missing=()
for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0

[ "$(id -u)" -eq 0 ] || { echo "install_slurm.sh: needs root to install: ${missing[*]}" >&2; exit 1; }

export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null
apt-get install -y -qq --no-install-recommends "${packages[@]}" >/dev/null
echo "install_slurm.sh: installed ${missing[*]}"
