"""The images' Dockerfiles, linted with hadolint (fetched from PyPI with the chart's tools): the
gateway's, whose install step stays the same as the README's install command (without the dev
extras), and the EFA engine image's (deploy/engine-image), which must keep what makes NIXL's
LIBFABRIC backend work and its build-time check."""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import ROOT, Tools

ENGINE_DOCKERFILE = ROOT / "deploy" / "engine-image" / "Dockerfile"


@pytest.mark.parametrize("dockerfile", [ROOT / "Dockerfile", ENGINE_DOCKERFILE], ids=["gateway", "engine"])
def test_hadolint_finds_nothing(tools: Tools, dockerfile: Path):
    out = subprocess.run(
        [str(tools.hadolint), "--no-color", str(dockerfile)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip() == ""


def test_engine_image_keeps_the_efa_essentials():
    text = ENGINE_DOCKERFILE.read_text()
    assert "ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0" in text
    assert re.search(r"ARG EFA_INSTALLER_VERSION=\d+\.\d+\.\d+\n", text)
    assert re.search(r"ARG NIXL_VERSION=\d+\.\d+\.\d+\n", text)
    # user space only, as AWS documents for containers, and no Open MPI
    assert "./efa_installer.sh -y --skip-kmod --skip-limit-conf --skip-mpi --no-verify" in text
    for env in ("LD_LIBRARY_PATH=/opt/amazon/efa/lib", "FI_PROVIDER=efa", "FI_EFA_USE_DEVICE_RDMA=1"):
        assert env in text, env
    # the build fails when NIXL's LIBFABRIC plugin has an unresolved library
    assert 'ldd-resolves "${libdir}/plugins/libplugin_LIBFABRIC.so" libcuda.so.1' in " ".join(
        text.replace("\\\n", " ").split()
    )
    # the preflight lands where the chart mounts it
    assert "COPY helm/pdgate/files/preflight.py /opt/pdgate/preflight/preflight.py" in text


def _pip_install_args(command: str) -> list[str]:
    """The arguments of the first `pip install` in a shell command line."""
    for part in re.split(r"&&|;", command):
        words = shlex.split(part)
        if words[:2] == ["pip", "install"]:
            return words[2:]
    raise AssertionError(f"no pip install in {command!r}")


def _normalized(args: list[str]) -> list[str]:
    """`-e '.[dev]'` is `.` for an image: no editable install, no dev extras."""
    return [re.sub(r"\[dev\]$", "", a) for a in args if a not in ("-e", "--editable")]


def test_install_step_matches_the_readme():
    readme = (ROOT / "README.md").read_text()
    [command] = re.findall(r"```bash\n(python3 -m venv[^\n]*)\n```", readme)[:1]
    dockerfile = (ROOT / "Dockerfile").read_text()
    runs = [line.removeprefix("RUN ").strip() for line in dockerfile.splitlines() if line.startswith("RUN ")]
    installs = [r for r in runs if "pip install" in r]
    assert len(installs) == 1, installs
    assert _normalized(_pip_install_args(command)) == _pip_install_args(installs[0]) == ["."]
    # the image runs the gateway as a non-root user on the config path the chart mounts
    assert re.search(r"^USER 10001$", dockerfile, re.M)
    assert 'CMD ["serve", "--config", "/etc/pdgate/config.yaml"]' in dockerfile


# --- The engine image's hardening: parsed from the Dockerfile, and build-checks.sh run for real ---

ENGINE_DIR = ROOT / "deploy" / "engine-image"
CHECKS = ENGINE_DIR / "build-checks.sh"
CHECKS_IN_IMAGE = "/opt/pdgate/build/checks.sh"
CONSTRAINTS = "/opt/pdgate/build/constraints.txt"


def _instructions(text: str) -> list[tuple[str, str]]:
    """(KEYWORD, arguments) per Dockerfile instruction: continuations joined, comments dropped."""
    out: list[tuple[str, str]] = []
    current: list[str] = []
    for line in text.splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if current and line.lstrip().startswith("#"):
            continue
        current.append(line.rstrip().removesuffix("\\").strip())
        if not line.rstrip().endswith("\\"):
            keyword, _, args = " ".join(current).partition(" ")
            out.append((keyword.upper(), args.strip()))
            current = []
    assert not current, "the Dockerfile ends inside a continued instruction"
    return out


def _engine() -> list[tuple[str, str]]:
    return _instructions(ENGINE_DOCKERFILE.read_text())


def _runs() -> list[str]:
    return [args for keyword, args in _engine() if keyword == "RUN"]


def _commands(run: str) -> list[list[str]]:
    """The simple commands of a RUN line as words, quotes removed: split on && || | ;, without
    redirections, braces and leading VAR=value assignments (a "$(...)" assignment stays, one word)."""
    lexer = shlex.shlex(run, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    tokens = list(lexer)
    commands: list[list[str]] = []
    words: list[str] = []
    skip = False
    for token in tokens:
        if skip:
            skip = False
        elif token in ("&&", "||", "|", ";"):
            commands, words = [*commands, words] if words else commands, []
        elif token in (">", ">>", "<"):
            skip = True
        elif token in ("{", "}") or (not words and re.fullmatch(r"[A-Za-z_]\w*=.*", token) and "$(" not in token):
            continue
        else:
            words.append(token)
    return [*commands, words] if words else commands


def _expand(word: str, args: dict[str, str]) -> str:
    """BuildKit's ${NAME} and ${NAME:?message} (an error when NAME is unset or empty)."""

    def one(match: re.Match[str]) -> str:
        name, message = match.group(1), match.group(3)
        value = args.get(name, "")
        if match.group(2) and not value:
            raise ValueError(f"{name}: {message}")
        return value

    return re.sub(r"\$\{(\w+)(:\?([^}]*))?\}", one, word)


def _pip(run: str, verb: str) -> list[list[str]]:
    """The arguments of every `python3 -m pip VERB` in a RUN line."""
    return [c[4:] for c in _commands(run) if c[:4] == ["python3", "-m", "pip", verb]]


def _args_before_from() -> dict[str, str | None]:
    args: dict[str, str | None] = {}
    for keyword, value in _engine():
        if keyword == "FROM":
            break
        if keyword == "ARG":
            name, eq, default = value.partition("=")
            args[name] = default if eq else None
    return args


def test_engine_base_image_is_pinned_by_a_required_digest():
    froms = [value for keyword, value in _engine() if keyword == "FROM"]
    assert len(froms) == 1, froms
    # no default digest: a build without --build-arg VLLM_IMAGE_DIGEST cannot pull anything
    defaults = _args_before_from()
    assert defaults == {"VLLM_IMAGE": "vllm/vllm-openai:v0.32.0", "VLLM_IMAGE_DIGEST": None}
    args = {k: v for k, v in defaults.items() if v is not None}
    for unset_or_empty in ({}, {"VLLM_IMAGE_DIGEST": ""}):
        with pytest.raises(ValueError, match=r"VLLM_IMAGE_DIGEST: .*--build-arg_VLLM_IMAGE_DIGEST=.*README\.md"):
            _expand(froms[0], {**args, **unset_or_empty})
    digest = "sha256:" + "0" * 64
    assert _expand(froms[0], {**args, "VLLM_IMAGE_DIGEST": digest}) == f"vllm/vllm-openai:v0.32.0@{digest}"
    # the image records what it was built on
    labels = " ".join(value for keyword, value in _engine() if keyword == "LABEL")
    assert 'org.opencontainers.image.base.digest="${VLLM_IMAGE_DIGEST}"' in labels


def test_engine_installer_checksum_is_mandatory_and_checked_before_use():
    stage_args = [value for keyword, value in _engine() if keyword == "ARG"]
    assert "EFA_INSTALLER_SHA256" in stage_args  # declared without a default
    assert not any(a.startswith("EFA_INSTALLER_SHA256=") for a in stage_args)
    runs = _runs()
    # the first RUN refuses an empty or malformed checksum before anything is downloaded
    assert ["bash", CHECKS_IN_IMAGE, "sha256-arg", "EFA_INSTALLER_SHA256", "${EFA_INSTALLER_SHA256}"] in _commands(
        runs[0]
    )
    [install] = [r for r in runs if "efa_installer.sh" in r]
    commands = _commands(install)
    tarball = "aws-efa-installer-${EFA_INSTALLER_VERSION}.tar.gz"
    verify = ["bash", CHECKS_IN_IMAGE, "verify-sha256", tarball, "${EFA_INSTALLER_SHA256}", "EFA_INSTALLER_SHA256"]
    assert verify in commands
    unpack = next(i for i, c in enumerate(commands) if c[0] == "tar")
    assert commands.index(verify) < unpack
    assert any(c[0] == "curl" for c in commands[: commands.index(verify)])


def test_engine_installer_is_user_space_only_without_mpi():
    [install] = [r for r in _runs() if "efa_installer.sh" in r]
    [installer] = [c for c in _commands(install) if c[0] == "./efa_installer.sh"]
    assert installer[1:] == ["-y", "--skip-kmod", "--skip-limit-conf", "--skip-mpi", "--no-verify"]
    # and the build fails if an Open MPI got installed anyway
    assert ["test", "!", "-e", "/opt/amazon/openmpi"] in _commands(install)


def test_engine_constraints_cover_every_pip_install_and_pip_check_runs_last():
    runs = _runs()
    constraints_run = next(i for i, r in enumerate(runs) if "base-freeze.txt" in r)
    commands = _commands(runs[constraints_run])
    assert ["python3", "-m", "pip", "list", "--format=freeze"] in commands  # the base's full freeze
    [make] = [c for c in commands if c[:3] == ["bash", CHECKS_IN_IMAGE, "constraints"]]
    assert make[4] == CONSTRAINTS and set(make[5:]) == {"nixl", "nixl-cu12", "nixl-cu13", "lmcache"}
    installs = [(i, args) for i, r in enumerate(runs) for args in _pip(r, "install")]
    assert installs, "no pip install in the engine Dockerfile"
    for i, args in installs:
        assert i > constraints_run, args
        assert args[args.index("-c") + 1] == CONSTRAINTS, args
    # --no-deps for the nixl meta package only (its dependencies are both NIXL builds)
    no_deps = [args for _, args in installs if "--no-deps" in args]
    assert no_deps == [["--no-cache-dir", "-c", CONSTRAINTS, "--no-deps", "nixl==${NIXL_VERSION}"]]
    # pip check is the last thing the install step does, against the base image's own report
    [install_run] = {runs[i] for i, _ in installs}
    baseline = "/opt/pdgate/build/pip-check.baseline"
    allowed = r"^nixl ${NIXL_VERSION} requires nixl-cu${other}, which is not installed\.$"
    assert _commands(install_run)[-1] == ["bash", CHECKS_IN_IMAGE, "pip-check", baseline, allowed]
    assert "python3 -m pip check > /opt/pdgate/build/pip-check.baseline" in runs[constraints_run]


def test_engine_installs_exactly_one_nixl_build():
    [install_run] = [r for r in _runs() if _pip(r, "install")]
    requested = [a for args in _pip(install_run, "install") for a in args if not a.startswith("-") and a != CONSTRAINTS]
    nixl = sorted(a for a in requested if a.lower().startswith("nixl"))
    assert nixl == ["nixl-cu${major}==${NIXL_VERSION}", "nixl==${NIXL_VERSION}"]
    assert "lmcache==${LMCACHE_VERSION}" in requested
    commands = _commands(install_run)
    assert commands[0] == [f"major=$(bash {CHECKS_IN_IMAGE} cuda-major)"]  # the CUDA torch was built for
    assert ["python3", "-m", "pip", "uninstall", "-y", "nixl", "nixl-cu${other}"] in commands
    assert ["bash", CHECKS_IN_IMAGE, "nixl-single", "${major}", "${NIXL_VERSION}"] in commands


def test_engine_nccl_finds_aws_ofi_nccl():
    env = " ".join(value for keyword, value in _engine() if keyword == "ENV")
    assert "NCCL_NET_PLUGIN=ofi" in env  # NCCL then dlopens libnccl-net-ofi.so
    path = re.sub(r"\$\{[^}]*\}$", "", re.search(r"LD_LIBRARY_PATH=(\S+)", env).group(1)).split(":")
    assert {"/opt/amazon/efa/lib", "/opt/amazon/ofi-nccl/lib64", "/opt/amazon/ofi-nccl/lib"} <= set(path)
    final = _commands(_runs()[-1])
    assert [f"ofi=$(bash {CHECKS_IN_IMAGE} on-loader-path libnccl-net-ofi.so)"] in final
    assert ["bash", CHECKS_IN_IMAGE, "ldd-resolves", "${ofi}", "libcuda.so.1", "libnvidia-ml.so.1"] in final


def test_engine_loads_lmcache_cuda_extension_at_build_time():
    final = _commands(_runs()[-1])
    # lmcache.cuda_ops, not just `import lmcache`, which only warns when the extension cannot load
    assert ["python3", "-c", "import lmcache.lmcache_native, lmcache.cuda_ops"] in final


def test_readme_build_command_passes_the_required_args():
    readme = (ENGINE_DIR / "README.md").read_text()
    builds = [b for b in re.findall(r"docker build [^`]*?\s\.\n", readme.replace("\\\n", " ")) if "engine-image" in b]
    assert builds, "no docker build command for the engine image in its README"
    for build in builds:
        assert "--build-arg VLLM_IMAGE_DIGEST=" in build and "--build-arg EFA_INSTALLER_SHA256=" in build, build


def _checks(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(CHECKS), *args], capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})}
    )


def test_checksum_check_refuses_empty_malformed_and_mismatching(tmp_path: Path):
    tarball = tmp_path / "aws-efa-installer-1.51.0.tar.gz"
    tarball.write_bytes(b"not really an installer\n")
    good = hashlib.sha256(tarball.read_bytes()).hexdigest()
    name = "EFA_INSTALLER_SHA256"

    empty = _checks("verify-sha256", str(tarball), "", name)
    assert empty.returncode != 0 and "EFA_INSTALLER_SHA256 is empty" in empty.stderr
    assert _checks("sha256-arg", name, "").returncode != 0
    malformed = _checks("verify-sha256", str(tarball), good[:-1], name)
    assert malformed.returncode != 0 and "not a SHA-256" in malformed.stderr
    other = hashlib.sha256(b"another file").hexdigest()
    mismatch = _checks("verify-sha256", str(tarball), other, name)
    assert mismatch.returncode != 0 and f"SHA-256 is {good}" in mismatch.stderr
    missing = _checks("verify-sha256", str(tmp_path / "absent.tar.gz"), good, name)
    assert missing.returncode != 0

    assert _checks("verify-sha256", str(tarball), good, name).returncode == 0
    assert _checks("verify-sha256", str(tarball), good.upper(), name).returncode == 0
    assert _checks("sha256-arg", name, good).returncode == 0


def test_constraints_drop_replaced_projects_and_refuse_urls(tmp_path: Path):
    freeze = tmp_path / "freeze.txt"
    freeze.write_text(
        "numpy==2.2.6\nNixl_CU12==1.5.0\nnixl==1.5.0\ntorch==2.13.0+cu130\nLMCache==0.5.5\nvllm==0.32.0\n"
    )
    out = tmp_path / "constraints.txt"
    run = _checks("constraints", str(freeze), str(out), "nixl", "nixl-cu12", "nixl-cu13", "lmcache")
    assert run.returncode == 0, run.stderr
    assert out.read_text().splitlines() == ["numpy==2.2.6", "torch==2.13.0+cu130", "vllm==0.32.0"]
    # a direct URL or an editable install would make pip reject the constraints file: refuse it here
    freeze.write_text("vllm @ file:///workspace/dist/vllm-0.32.0-cp38-abi3-linux_x86_64.whl\n")
    assert _checks("constraints", str(freeze), str(out)).returncode != 0


def _fake_python(tmp_path: Path, output: str, status: int) -> Path:
    """A `python3` that answers `-m pip check` with OUTPUT and exit status STATUS."""
    script = tmp_path / "python3"
    script.write_text(f"#!/bin/sh\ncat <<'EOF'\n{output}EOF\nexit {status}\n")
    script.chmod(0o755)
    return script


def test_pip_check_fails_only_on_new_conflicts(tmp_path: Path):
    baseline = tmp_path / "baseline"
    baseline.write_text("opentelemetry-exporter-otlp-common 0.66b2 has requirement opentelemetry-sdk~=1.45.2.\n")
    allow = r"^nixl 1.5.1 requires nixl-cu12, which is not installed\.$"
    expected = "nixl 1.5.1 requires nixl-cu12, which is not installed.\n" + baseline.read_text()
    python = _fake_python(tmp_path, expected, 1)
    assert _checks("pip-check", str(baseline), allow, env={"PYTHON": str(python)}).returncode == 0

    new = expected + "lmcache 0.5.6 has requirement numpy<=2.2.6, but you have numpy 2.3.5.\n"
    python = _fake_python(tmp_path, new, 1)
    run = _checks("pip-check", str(baseline), allow, env={"PYTHON": str(python)})
    assert run.returncode != 0 and "lmcache 0.5.6 has requirement numpy<=2.2.6" in run.stderr
    # without the allowance, the missing other build is a conflict too
    python = _fake_python(tmp_path, expected, 1)
    assert _checks("pip-check", str(baseline), env={"PYTHON": str(python)}).returncode != 0
    python = _fake_python(tmp_path, "No broken requirements found.\n", 0)
    assert _checks("pip-check", str(baseline), env={"PYTHON": str(python)}).returncode == 0


def _dist(site: Path, name: str, version: str) -> None:
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


@pytest.mark.parametrize(
    ("installed", "ok"),
    [
        ([("nixl", "1.5.1"), ("nixl-cu13", "1.5.1")], True),
        ([("nixl", "1.5.1"), ("nixl-cu13", "1.5.1"), ("nixl-cu12", "1.5.1")], False),  # both builds
        ([("nixl", "1.5.1"), ("nixl-cu12", "1.5.1")], False),  # the build for the other CUDA
        ([("nixl", "1.5.1"), ("nixl-cu13", "1.5.0")], False),  # another version
        ([("nixl-cu13", "1.5.1")], False),  # no meta package: `import nixl` would fail
        ([("nixl", "1.5.0"), ("nixl-cu13", "1.5.1")], False),
    ],
    ids=["one", "both", "other-cuda", "old-build", "no-meta", "old-meta"],
)
def test_nixl_single_build_check(tmp_path: Path, installed: list[tuple[str, str]], ok: bool):
    site = tmp_path / "site"
    for name, version in installed:
        _dist(site, name, version)
    run = _checks("nixl-single", "13", "1.5.1", env={"PYTHON": sys.executable, "PYTHONPATH": str(site)})
    assert (run.returncode == 0) is ok, run.stdout + run.stderr


def test_ldd_check_allows_only_driver_libraries(tmp_path: Path):
    ldd = tmp_path / "ldd"
    ldd.write_text(
        "#!/bin/sh\n"
        "printf '\\tlibfabric.so.1 => /opt/amazon/efa/lib/libfabric.so.1 (0x1)\\n'\n"
        "printf '\\tlibcuda.so.1 => not found\\n'\n"
        'if [ -n "$MISSING" ]; then printf "\\t%s => not found\\n" "$MISSING"; fi\n'
    )
    ldd.chmod(0o755)
    plugin = tmp_path / "libplugin_LIBFABRIC.so"
    plugin.write_bytes(b"")
    env = {"LDD": str(ldd)}
    assert _checks("ldd-resolves", str(plugin), "libcuda.so.1", env=env).returncode == 0
    assert _checks("ldd-resolves", str(plugin), env=env).returncode != 0
    run = _checks("ldd-resolves", str(plugin), "libcuda.so.1", env={**env, "MISSING": "libhwloc.so.15"})
    assert run.returncode != 0 and "libhwloc.so.15" in run.stderr
    assert _checks("ldd-resolves", "/bin/sh").returncode == 0  # the real ldd on a real binary
    text = tmp_path / "not-a-library.so"
    text.write_text("not ELF\n")
    assert _checks("ldd-resolves", str(text)).returncode != 0  # ldd fails: so does the check


def test_on_loader_path_finds_the_nccl_plugin_as_nccl_would(tmp_path: Path):
    lib64 = tmp_path / "ofi-nccl" / "lib64"
    lib64.mkdir(parents=True)
    (lib64 / "libnccl-net-ofi.so").write_bytes(b"")
    path = f"{tmp_path / 'efa'}:{tmp_path / 'ofi-nccl' / 'lib'}:{lib64}"
    run = _checks("on-loader-path", "libnccl-net-ofi.so", env={"LD_LIBRARY_PATH": path})
    assert run.returncode == 0 and run.stdout.strip() == str(lib64 / "libnccl-net-ofi.so")
    run = _checks("on-loader-path", "libnccl-net-ofi.so", env={"LD_LIBRARY_PATH": str(tmp_path / "efa")})
    assert run.returncode != 0 and "libnccl-net-ofi.so" in run.stderr
