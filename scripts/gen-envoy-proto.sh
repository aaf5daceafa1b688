#!/usr/bin/env bash
# Regenerate gateway/epp/proto/envoy_subset_pb2.py (+ .pyi) from envoy_subset.proto.
# grpcio-tools 1.71 bundles protoc 29: its code runs on protobuf >= 5.29 (the dependency's floor).
# Usage: scripts/gen-envoy-proto.sh   (needs `pip install 'grpcio-tools==1.71.*'` in the python on PATH,
# or PDGATE_PROTOC_PYTHON=/path/to/python)
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PDGATE_PROTOC_PYTHON:-python}"
"$py" -m grpc_tools.protoc -I gateway/epp/proto --python_out=gateway/epp/proto --pyi_out=gateway/epp/proto \
  gateway/epp/proto/envoy_subset.proto
