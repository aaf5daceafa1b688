#!/usr/bin/env bash
# Build-time checks for the EFA engine image (Dockerfile beside this file). The Dockerfile copies this
# script into the image and runs it, and tests/helm/test_dockerfile.py runs it here, so that every
# check that can fail a build is exercised without Docker. Each command exits non-zero, with one
# line on stderr that says what is wrong and what to do, when its check fails.
#
#   sha256-arg NAME VALUE              VALUE must be a SHA-256 (64 hex digits); NAME is the build arg
#   verify-sha256 FILE EXPECTED NAME   the same check on EXPECTED, then FILE's SHA-256 must equal it
#   constraints FREEZE OUT [NAME...]   FREEZE (`pip list --format=freeze`) minus the projects NAME...,
#                                      as a pip constraints file OUT (one name==version a line)
#   pip-check BASELINE [ALLOW_ERE]     `pip check` may report only what BASELINE (its output on the
#                                      base image) already reported and lines matching ALLOW_ERE
#   cuda-major                         print the CUDA major version torch was built for (12 or 13)
#   nixl-single MAJOR VERSION          exactly one NIXL build is installed, nixl-cuMAJOR==VERSION,
#                                      with the `nixl` meta package at VERSION
#   ldd-resolves FILE [SONAME...]      `ldd FILE` finds every library except the SONAMEs named
#   on-loader-path FILE_NAME           FILE_NAME is in a directory of LD_LIBRARY_PATH; prints its path
#
# Environment: PYTHON (default python3) is the interpreter whose packages are checked; LDD (default
# ldd) is the ldd to run.
set -euo pipefail

PYTHON=${PYTHON:-python3}
LDD=${LDD:-ldd}

die() {
    echo "build-checks: $*" >&2
    exit 1
}

normalize() {
    # PEP 503 project-name normalization, one name per input line.
    tr '[:upper:]' '[:lower:]' | sed -E 's/[-_.]+/-/g'
}

cmd_sha256_arg() {
    [[ $# -eq 2 ]] || die "usage: sha256-arg NAME VALUE"
    local name=$1 value=$2
    if [[ -z $value ]]; then
        die "${name} is empty: pass --build-arg ${name}=<sha256 of the tarball> (README.md, 'EFA installer checksum')"
    fi
    if [[ ! $value =~ ^[0-9a-fA-F]{64}$ ]]; then
        die "${name}=${value} is not a SHA-256 (64 hex digits)"
    fi
}

cmd_verify_sha256() {
    [[ $# -eq 3 ]] || die "usage: verify-sha256 FILE EXPECTED NAME"
    local file=$1 expected=$2 name=$3 actual
    cmd_sha256_arg "$name" "$expected"
    [[ -f $file ]] || die "${file}: no such file"
    actual=$(sha256sum -- "$file" | cut -d' ' -f1)
    if [[ $actual != "${expected,,}" ]]; then
        die "${file}: SHA-256 is ${actual}, ${name} says ${expected,,}: a different or corrupted download"
    fi
    echo "build-checks: ${file}: SHA-256 ${actual} as expected"
}

cmd_constraints() {
    [[ $# -ge 2 ]] || die "usage: constraints FREEZE OUT [NAME...]"
    local freeze=$1 out=$2 line name
    shift 2
    local -A drop=()
    for name in "$@"; do
        drop[$(normalize <<<"$name")]=1
    done
    [[ -s $freeze ]] || die "${freeze}: missing or empty (pip list --format=freeze printed nothing?)"
    : >"$out"
    while IFS= read -r line || [[ -n $line ]]; do
        [[ -z $line || $line == \#* ]] && continue
        # `pip list --format=freeze` prints name==version only; anything else would be a direct URL
        # or an editable install, which pip refuses in a constraints file.
        [[ $line =~ ^([A-Za-z0-9][A-Za-z0-9._-]*)==([^[:space:]]+)$ ]] || die "${freeze}: unexpected line '${line}'"
        name=$(normalize <<<"${BASH_REMATCH[1]}")
        [[ -n ${drop[$name]:-} ]] && continue
        echo "$line" >>"$out"
    done <"$freeze"
    echo "build-checks: ${out}: $(wc -l <"$out") pins from the base image (left out: ${*:-nothing})"
}

cmd_pip_check() {
    [[ $# -ge 1 && $# -le 2 ]] || die "usage: pip-check BASELINE [ALLOW_ERE]"
    local baseline=$1 allow=${2:-} out unexpected
    [[ -f $baseline ]] || die "${baseline}: no such file"
    if out=$("$PYTHON" -m pip check 2>&1); then
        echo "$out"
        return 0
    fi
    unexpected=$(grep -v -x -F -f "$baseline" <<<"$out" || true)
    if [[ -n $allow ]]; then
        unexpected=$(grep -v -E -- "$allow" <<<"$unexpected" || true)
    fi
    if [[ -n $unexpected ]]; then
        echo "$out" >&2
        die "pip check found conflicts the base image did not have: $(paste -s -d';' <<<"$unexpected")"
    fi
    echo "build-checks: pip check reports only what is expected:"
    echo "$out"
}

cmd_cuda_major() {
    [[ $# -eq 0 ]] || die "usage: cuda-major"
    "$PYTHON" - <<'EOF'
import sys

import torch

cuda = torch.version.cuda
if not cuda:
    sys.exit(f"build-checks: torch {torch.__version__} has no CUDA build (torch.version.cuda is {cuda!r})")
major = cuda.split(".")[0]
if major not in ("12", "13"):
    sys.exit(f"build-checks: torch {torch.__version__} is built for CUDA {cuda}; NIXL has wheels for 12 and 13")
print(major)
EOF
}

cmd_nixl_single() {
    [[ $# -eq 2 ]] || die "usage: nixl-single MAJOR VERSION"
    "$PYTHON" - "$@" <<'EOF'
import importlib.metadata as md
import re
import sys

major, version = sys.argv[1:]
want = f"nixl-cu{major}"


def canonical(name):
    return re.sub(r"[-_.]+", "-", name or "").lower()


installed = {}
for dist in md.distributions():
    name = canonical(dist.metadata["Name"])
    if name == "nixl" or re.fullmatch(r"nixl-(cu\d+|rocm)", name):
        installed.setdefault(name, set()).add(dist.version)

builds = {name: versions for name, versions in installed.items() if name != "nixl"}
errors = []
if set(builds) != {want}:
    found = ", ".join(f"{n}=={'/'.join(sorted(v))}" for n, v in sorted(builds.items())) or "none"
    errors.append(f"NIXL builds installed: {found}; want exactly {want} (two builds can load each other's UCX)")
elif builds[want] != {version}:
    errors.append(f"{want} is at {'/'.join(sorted(builds[want]))}, want {version}")
if installed.get("nixl") != {version}:
    errors.append(f"the nixl meta package is at {'/'.join(sorted(installed.get('nixl', ()))) or 'nothing'}, want {version}")
if errors:
    sys.exit("build-checks: " + "; ".join(errors))
print(f"build-checks: one NIXL build: {want}=={version} (nixl=={version} picks it by torch's CUDA {major})")
EOF
}

cmd_ldd_resolves() {
    [[ $# -ge 1 ]] || die "usage: ldd-resolves FILE [SONAME...]"
    local file=$1 soname out missing
    shift
    [[ -e $file ]] || die "${file}: no such file"
    out=$("$LDD" "$file" 2>&1) || die "ldd ${file} failed: ${out}"
    missing=$(grep 'not found' <<<"$out" || true)
    for soname in "$@"; do
        missing=$(grep -v -F "${soname} => not found" <<<"$missing" || true)
    done
    if [[ -n $missing ]]; then
        die "${file} needs libraries the loader cannot find: $(tr -s ' \t\n' ' ' <<<"$missing")"
    fi
    echo "build-checks: ${file}: every library resolves${*:+ (except ${*}, mounted from the driver at run time)}"
}

cmd_on_loader_path() {
    [[ $# -eq 1 ]] || die "usage: on-loader-path FILE_NAME"
    local file=$1 dir
    local -a dirs
    IFS=: read -r -a dirs <<<"${LD_LIBRARY_PATH:-}"
    for dir in "${dirs[@]}"; do
        if [[ -n $dir && -e $dir/$file ]]; then
            echo "$dir/$file"
            return 0
        fi
    done
    die "${file} is in no directory of LD_LIBRARY_PATH (${LD_LIBRARY_PATH:-empty})"
}

main() {
    [[ $# -ge 1 ]] || die "usage: build-checks.sh COMMAND [ARG...] (see the comment at the top)"
    local command=$1
    shift
    case $command in
    sha256-arg) cmd_sha256_arg "$@" ;;
    verify-sha256) cmd_verify_sha256 "$@" ;;
    constraints) cmd_constraints "$@" ;;
    pip-check) cmd_pip_check "$@" ;;
    cuda-major) cmd_cuda_major "$@" ;;
    nixl-single) cmd_nixl_single "$@" ;;
    ldd-resolves) cmd_ldd_resolves "$@" ;;
    on-loader-path) cmd_on_loader_path "$@" ;;
    *) die "unknown command '${command}'" ;;
    esac
}

main "$@"
