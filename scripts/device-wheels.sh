#!/usr/bin/env bash
# Wheels for a lent 16-core machine (CPython 3.12, x86-64, nothing fetched there), into .whl/:
# what pdgate and vllm-router need that its image lacks or holds at a version pdgate does not
# accept. The machine's image already holds the large ones named in SKIP (numpy, the Hugging Face
# hub, tokenizers, tiktoken...); carrying them would pass the 64 MiB a run may carry. Then run
# scripts/device-streams.sh there with .whl carried (docs/benchmarks.md, "Side by side on cores of
# its own"). Needs pip and the network here; prints the bundle's size.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${DEST:-.whl}
VLLM_ROUTER=${VLLM_ROUTER:-0.1.17}
# Held by the machine's image (its package list) at versions pdgate and vllm-router accept.
SKIP="anyio certifi charset_normalizer click filelock fsspec h11 hf_xet huggingface_hub idna jinja2
markdown_it_py markupsafe mdurl numpy packaging pygments python_dateutil pyyaml regex requests rich
safetensors shellingham six tiktoken tokenizers tqdm typer typing_extensions urllib3 uvloop attrs"
platforms=()
for p in manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_26 manylinux_2_24 \
    manylinux_2_17 manylinux2014 manylinux_2_5 manylinux1; do
    platforms+=(--platform "${p}_x86_64")
done
rm -rf "$DEST" && mkdir -p "$DEST"
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
    -d "$DEST" . "vllm-router==$VLLM_ROUTER"
for name in $SKIP; do
    rm -f "$DEST/$name"-[0-9]*.whl
done
rm -f "$DEST"/pdgate-*  # the gateway itself travels as the working tree
size=$(du -sm "$DEST" | cut -f1)
echo "$(ls "$DEST" | wc -l) wheels, ${size} MiB in $DEST (a run carries at most 64 MiB with the working tree)"
if [ "$size" -gt 52 ]; then
    echo "too large to carry with the working tree: add what the machine's image holds to SKIP" >&2
    exit 1
fi
