#!/usr/bin/env bash
# Installs the Debian packages rolloutd's runtimes and tests need, once.
# Idempotent: does nothing when every package is already installed.
# `system-packages.sh demo`: only what `make demo` needs (the sandbox runtime and its seccomp compiler).
set -euo pipefail
# mmdebstrap (+ debootstrap as the fallback): the Debian bookworm root filesystems `rolloutd image build` makes
# slirp4netns: outbound NAT for a sandbox with network: true, in its own network namespace (sandbox/host/netns.py);
# iproute2 (ip) writes the routes that keep it off the node's own and private addresses
# podman + buildah: the rolloutd container image (charts/image/Containerfile, `make image`, tests/image); runc
# beside podman's crun, which refuses hosts with a hybrid cgroup hierarchy (charts/image/build.py picks runc there)
# unzip: kubectl and helm come out of an npm package's zip (.ci/kube-tools.sh)
# chromium + chromium-driver: tests/ui drive the web UI in a headless browser (selenium)
# postgresql: the store's tests run on a real server too (tests/support/postgres.py starts one per session)
PKGS=(bubblewrap slirp4netns iproute2 python3-seccomp tmux slurmctld slurmd slurm-client munge mmdebstrap debootstrap podman buildah runc unzip
      chromium chromium-driver postgresql)
[ "${1:-all}" = demo ] && PKGS=(bubblewrap python3-seccomp)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ]; then
  echo "missing system packages: ${missing[*]} (run as root, or install them: apt-get install ${missing[*]})" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}"
