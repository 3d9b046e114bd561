#!/usr/bin/env bash
# System packages the build and the C++ tests need: GoogleTest (core tests), ninja (builds),
# ccache (incremental rebuilds), cmake. Installs only what is missing.
set -euo pipefail
packages=(libgtest-dev ninja-build ccache cmake g++)
missing=()
for p in "${packages[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing system packages: ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi
