#!/usr/bin/env bash
# Issue 32's side-by-side on a machine with cores to spare (a lent 16-core one): pdgate and
# vllm-router each pinned to 1, 2, 4 (GATEWAY_CORES) cores of their own, the lean backend and the
# load generators on the upper half of the cores, 2,000 streams x 256 chunks at 50 tokens/s
# opened over 2 s (bench/streams.py); pdgate with as many workers as cores, migration on and off.
# Then the CPU per request with the gateways on the last core (bench.overhead --pin; OVERHEAD_REQUESTS
# 0 skips it). One JSON per run, the machine's description and a log, in $OUT. Run from the repository
# root; with .whl/ (scripts/device-wheels.sh) carried, its wheels are installed first.
#
#   OUT=/tmp/out scripts/device-streams.sh       # STREAMS, GATEWAY_CORES, PER_RUN_S to change
set -uo pipefail
OUT=${OUT:-/tmp/pdgate-device}
WHEELS=${WHEELS:-.whl}
SITE=${SITE:-/tmp/pdgate-site}
PY=${PY:-python3}
STREAMS=${STREAMS:-2000}
TOKENS=${TOKENS:-256}
RAMP_S=${RAMP_S:-2}
GATEWAY_CORES=${GATEWAY_CORES:-1 2 4}
PER_RUN_S=${PER_RUN_S:-170}
OVERHEAD_REQUESTS=${OVERHEAD_REQUESTS:-1000}
mkdir -p "$OUT"
if compgen -G "$WHEELS/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl ||
        { echo "installing the carried wheels failed" | tee "$OUT/log.txt"; exit 1; }
    export PYTHONPATH="$SITE:$PWD" PATH="$SITE/bin:$PATH"
else
    export PYTHONPATH="$PWD"
fi
export PYTHONUNBUFFERED=1
{
    date -u
    nproc
    lscpu | grep -E "Model name|^CPU\(s\)|Thread|NUMA node\(s\)"
    free -g | head -2
    command -v nvidia-smi >/dev/null && nvidia-smi -L
    "$PY" --version
} >"$OUT/machine.txt" 2>&1
router=$(command -v vllm-router || true)
n=$(nproc)
load="$((n / 2))-$((n - 1))"
for g in $GATEWAY_CORES; do
    if [ "$g" -gt "$((n / 2))" ]; then
        echo "skipping $g gateway cores: only $((n / 2)) below the load's" | tee -a "$OUT/log.txt"
        continue
    fi
    targets="backend,pdgate-w$g,pdgate-w$g-nomig${router:+,vllm-router}"
    echo "== gateway cores 0-$((g - 1)), load $load, targets $targets" | tee -a "$OUT/log.txt"
    timeout "$PER_RUN_S" "$PY" -m bench.streams --streams "$STREAMS" --tokens "$TOKENS" --ramp-s "$RAMP_S" \
        --clients "$(((n - n / 2) / 2 > 1 ? (n - n / 2) / 2 : 1))" --targets "$targets" \
        --gateway-cores "0-$((g - 1))" --load-cores "$load" ${router:+--vllm-router "$router"} \
        --out "$OUT/streams-g$g.json" --plot "" 2>&1 | grep -v "PyTorch was not found" | tee -a "$OUT/log.txt"
done
if [ "$OVERHEAD_REQUESTS" -gt 0 ]; then
    echo "== CPU per request, gateways on the last core" | tee -a "$OUT/log.txt"
    timeout "$PER_RUN_S" "$PY" -m bench.overhead --pin --requests "$OVERHEAD_REQUESTS" --rounds 2 \
        ${router:+--vllm-router "$router"} --out "$OUT/overhead-pin.json" 2>&1 |
        grep -v "PyTorch was not found" | tee -a "$OUT/log.txt"
fi
ls "$OUT"
