#!/usr/bin/env python3
"""pdgate engine preflight: prove the KV data path before an engine takes traffic.

Why it exists: a vLLM engine with the NixlConnector starts and answers /health even when its KV
transfer path cannot work (no EFA user-space libraries in the image, NIXL's LIBFABRIC plugin unable
to load, no EFA device in the pod, UCX told to skip GPU memory). P/D requests then fail or fall back
much later, far from the cause. The chart mounts this file from a ConfigMap and runs it:

  check  (init container) the backend's prerequisites, then a NIXL agent that registers a buffer;
  serve  (helm test, prefill side) a buffer with a known pattern, offered to --peers pullers;
  pull   (helm test, decode side) a NIXL READ of that buffer, checked byte for byte;
  l2     (helm test, every LMCache engine) a TCP connection to the LMCache L2 store this pod's
         LMCache is configured with (a Redis also answers PING), from the engine's own pod.

Each run ends with one line on stdout, `preflight ok: ...` (exit 0) or `preflight FAILED: <what is
missing>; <what to do>` (exit 1). Needs Python 3.10+, nixl, and torch only for GPU buffers.
Descriptors travel as plain JSON (NIXL's deserialize_descs is pickle: never fed from a socket).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import logging
import mmap
import os
import re
import shutil
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PROTO = 1
MAX_FRAME = 16 << 20  # bound on any message read from a peer (agent metadata is a few KiB)
CUDA_TLS = ("cuda_copy", "cuda")  # UCX needs cuda_copy (or the `cuda` alias) to handle GPU memory
EFA_BIN = "/opt/amazon/efa/bin"


class Fail(Exception):
    """A preflight verdict: '<what is missing>; <what to do>'."""


def ucx_tls_problem(tls: str | None) -> str | None:
    """Why this UCX_TLS cannot move GPU memory (None when it can, or when UCX chooses itself)."""
    if not tls or not tls.strip():
        return None
    names = {t.strip() for t in tls.strip().lstrip("^").split(",") if t.strip()}
    if tls.strip().startswith("^"):  # an exclusion list
        gone = names & set(CUDA_TLS)
        return f"UCX_TLS={tls} excludes {', '.join(sorted(gone))}" if gone else None
    if "all" in names or names & set(CUDA_TLS):
        return None
    return f"UCX_TLS={tls} has no cuda_copy, so UCX cannot move GPU memory"


def check_efa(want: int) -> str:
    """fi_info must exist and list at least `want` EFA RDM domains; returns a short summary."""
    fi_info = shutil.which("fi_info") or shutil.which("fi_info", path=EFA_BIN)
    if not fi_info:
        raise Fail(
            "fi_info not found: the image has no EFA user-space libraries; build deploy/engine-image "
            "(vLLM's stock image does not carry them, and the host's are not visible in the container)"
        )
    try:
        out = subprocess.run([fi_info, "-p", "efa", "-t", "FI_EP_RDM"], capture_output=True, text=True, timeout=60)
        ver = subprocess.run([fi_info, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as err:
        raise Fail(f"fi_info could not run ({err}); check the image's EFA install") from None
    ok = out.returncode == 0 and "provider: efa" in out.stdout
    domains = set(re.findall(r"^\s*domain:\s*(\S+)", out.stdout, re.M)) if ok else set()
    if len(domains) < max(want, 1):
        raise Fail(
            f"{len(domains)} EFA devices visible (fi_info -p efa, {max(want, 1)} wanted): request "
            "vpc.amazonaws.com/efa in the pod, on an EFA-enabled node with the EFA device plugin"
        )
    provider = os.environ.get("FI_PROVIDER", "")
    if provider and "efa" not in provider.split(","):
        raise Fail(f"FI_PROVIDER={provider} hides EFA from libfabric; set FI_PROVIDER=efa")
    lib = re.search(r"^libfabric:\s*(\S+)", ver, re.M)
    note = "" if provider else " (FI_PROVIDER unset: NIXL may fall back to libfabric's tcp provider)"
    return f"{len(domains)} EFA devices, libfabric {lib.group(1) if lib else 'unknown'}{note}"


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def hugepage_risk() -> str | None:
    """libfabric's EFA provider puts bounce buffers on 2 MiB hugepages when the node has some; a
    pod whose hugetlb limit is 0 (none requested) can then mmap them and die of SIGBUS on first touch."""
    if os.environ.get("FI_EFA_USE_HUGE_PAGE", "1").strip() == "0":
        return None
    total = re.search(r"^HugePages_Total:\s*(\d+)", _read("/proc/meminfo"), re.M)
    if not total or int(total.group(1)) == 0:
        return None
    limit = _read("/sys/fs/cgroup/hugetlb.2MB.max") or _read("/sys/fs/cgroup/hugetlb/hugetlb.2MB.limit_in_bytes")
    if limit != "0" or _read("/sys/fs/cgroup/hugetlb.2MB.rsvd.max") == "0":  # rsvd 0: mmap fails cleanly
        return None
    return (
        f"the node has {total.group(1)} hugepages but this pod may use none, so libfabric can die of SIGBUS on "
        "hugepage bounce buffers: request hugepages-2Mi (e.g. 5120Mi) in the pod, or set FI_EFA_USE_HUGE_PAGE=0"
    )


def resolve_device(requested: str | None) -> str:
    if requested == "cpu":
        return "cpu"
    try:
        import torch

        has_gpu = bool(torch.cuda.is_available())
    except ImportError:
        has_gpu = False
    if requested is None:
        return "cuda" if has_gpu else "cpu"
    if not has_gpu:
        raise Fail(
            "--device cuda but torch sees no CUDA GPU: request nvidia.com/gpu for the pod "
            "(and run the engine image, which has torch), or use --device cpu"
        )
    return "cuda"


def preconditions(backend: str, requested: str | None, efa_devices: int) -> tuple[str, str]:
    """Everything that can be judged before NIXL: returns (device, summary)."""
    summary = ""
    if backend == "UCX" and requested in (None, "cuda"):
        problem = ucx_tls_problem(os.environ.get("UCX_TLS"))
        if problem and (requested == "cuda" or resolve_device(None) == "cuda"):
            raise Fail(f"{problem}; add cuda_copy (llm-d uses UCX_TLS=sm,cuda_ipc,cuda_copy,tcp) or unset UCX_TLS")
        summary = f"UCX_TLS={os.environ.get('UCX_TLS') or '(unset)'}"
    if backend == "LIBFABRIC":
        summary = check_efa(efa_devices)
        risk = hugepage_risk()
        if risk:
            raise Fail(risk)
    return resolve_device(requested), summary


class Buffer:
    """A registered-to-be region in DRAM (anonymous mmap, page aligned) or VRAM (a torch tensor)."""

    def __init__(self, size: int, device: str) -> None:
        self.size, self.device = size, device
        self.mem_type = "VRAM" if device == "cuda" else "DRAM"
        if device == "cuda":
            import torch

            self.tensor = torch.zeros(size, dtype=torch.uint8, device="cuda")
            self.addr, self.dev_id = self.tensor.data_ptr(), self.tensor.get_device()
        else:
            self.mm = mmap.mmap(-1, size)
            self.addr, self.dev_id = ctypes.addressof(ctypes.c_char.from_buffer(self.mm)), 0

    def pattern(self) -> Any:
        data = (bytes(range(251)) * (self.size // 251 + 1))[: self.size]  # 251 is prime: no page-aligned repeats
        if self.device != "cuda":
            return data
        import torch

        return torch.frombuffer(bytearray(data), dtype=torch.uint8)

    def fill(self) -> None:
        if self.device == "cuda":
            self.tensor.copy_(self.pattern())
        else:
            self.mm[:] = self.pattern()

    def matches(self) -> bool:
        if self.device == "cuda":
            return bool(self.tensor.cpu().equal(self.pattern()))
        return bool(self.mm[:] == self.pattern())

    def descs(self) -> list[tuple[int, int, int]]:
        return [(self.addr, self.size, self.dev_id)]


def plugin_load_error(backend: str) -> str | None:
    """Why NIXL's plugin for `backend` does not load: the dynamic loader's own message (None: it loads)."""
    plugin_dir = os.environ.get("NIXL_PLUGIN_DIR")
    if not plugin_dir:  # NIXL looks in plugins/ next to the libnixl.so it loaded
        lib = re.search(r"(/\S*/libnixl\.so)\s*$", _read("/proc/self/maps"), re.M)
        plugin_dir = str(Path(lib.group(1)).parent / "plugins") if lib else ""
    path = Path(plugin_dir) / f"libplugin_{backend}.so"
    try:
        ctypes.CDLL(str(path))
    except OSError as err:  # the loader names the first library it cannot find
        return str(err) if path.exists() else f"{path} does not exist"
    return None


def make_agent(backend: str, role: str) -> Any:
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as err:
        raise Fail(f"NIXL is not installed ({err}); run the engine image (deploy/engine-image)") from None
    for handler in logging.getLogger("nixl").handlers:  # NIXL logs to stdout: keep stdout for the verdict
        if isinstance(handler, logging.StreamHandler):
            handler.setStream(sys.stderr)
    name = f"pdgate-preflight-{role}-{socket.gethostname()}-{os.getpid()}"
    agent, failure = None, "NIXL skipped the backend (see its log)"
    try:
        agent = nixl_agent(name, nixl_agent_config(backends=[backend]))
    except Exception as err:  # NIXL raises its own binding errors (NIXL_ERR_NOT_FOUND, ...)
        failure = f"{type(err).__name__}: {err}"
    if agent is not None and backend in agent.backends:
        return agent
    cause = plugin_load_error(backend) or f"the plugin loads but the backend does not start ({failure})"
    hint = "set LD_LIBRARY_PATH to include /opt/amazon/efa/lib (deploy/engine-image does)"
    if "libcuda" in cause:
        hint = "the NVIDIA driver library is not in the container: run on a GPU node and request nvidia.com/gpu"
    elif "libhwloc" in cause:
        hint = "install libhwloc15 in the image (deploy/engine-image does)"
    elif backend == "UCX":
        hint = "check UCX_TLS and the NIXL install"
    raise Fail(f"NIXL cannot load its {backend} plugin: {cause}; {hint}")


def register(agent: Any, buf: Buffer, backend: str) -> Any:
    try:
        return agent.register_memory([(buf.addr, buf.size, buf.dev_id, "")], buf.mem_type, backends=[backend])
    except Exception as err:
        hint = "check the pod's locked-memory limit (ulimit -l; IPC_LOCK)"
        if buf.device == "cuda":
            hint = "check GPUDirect RDMA (FI_EFA_USE_DEVICE_RDMA=1, dmabuf or nvidia-peermem)"
        raise Fail(
            f"NIXL {backend} could not register {buf.size >> 20} MiB of {buf.mem_type} "
            f"({type(err).__name__}: {err}); {hint}"
        ) from None


def remaining(deadline: float, what: str) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise Fail(f"timed out {what}; raise --timeout or check the peer's log")
    return left


def send_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(struct.pack("!I", len(payload)) + payload)


def recv_frame(sock: socket.socket, deadline: float, what: str) -> bytes:
    def exact(n: int) -> bytes:
        chunks, got = [], 0
        while got < n:
            sock.settimeout(remaining(deadline, f"waiting for {what}"))
            try:
                chunk = sock.recv(min(n - got, 1 << 20))
            except TimeoutError:
                raise Fail(f"timed out waiting for {what}; raise --timeout or check the peer's log") from None
            if not chunk:
                raise Fail(f"the peer closed the connection before sending {what}; see the peer's log")
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    (length,) = struct.unpack("!I", exact(4))
    if length > MAX_FRAME:
        raise Fail(f"the peer sent a {length}-byte {what} (limit {MAX_FRAME}): it is not preflight.py serve")
    return exact(length)


def cmd_check(args: argparse.Namespace) -> str:
    device, summary = preconditions(args.backend, args.device, args.efa_devices)
    agent = make_agent(args.backend, "check")
    buf = Buffer(1 << 20, device)
    agent.deregister_memory(register(agent, buf, args.backend), backends=[args.backend])
    return f"NIXL {args.backend} agent registered 1 MiB of {buf.mem_type}; {summary}".rstrip("; ")


def cmd_serve(args: argparse.Namespace) -> str:
    deadline = time.monotonic() + args.timeout
    device, _ = preconditions(args.backend, args.device, 1)
    agent = make_agent(args.backend, "serve")
    buf = Buffer(args.size_mib << 20, device)
    buf.fill()
    register(agent, buf, args.backend)
    header = json.dumps(
        {"proto": PROTO, "backend": args.backend, "size": buf.size, "mem": buf.mem_type, "descs": buf.descs()}
    ).encode()
    metadata = agent.get_agent_metadata()
    with socket.create_server((args.host, args.port), backlog=args.peers) as server:
        print(
            f"preflight: serving {args.size_mib} MiB of {buf.mem_type} over {args.backend} on "
            f"{args.host}:{args.port} for {args.peers} peer(s)",
            file=sys.stderr,
            flush=True,
        )
        reports = []
        for n in range(args.peers):
            server.settimeout(remaining(deadline, f"for peers: {n} of {args.peers} came"))
            try:
                conn, (peer, _) = server.accept()
            except TimeoutError:
                raise Fail(
                    f"timed out for peers: {n} of {args.peers} came; run preflight.py pull "
                    "against this pod, or raise --timeout"
                ) from None
            with conn:
                try:
                    send_frame(conn, header)
                    send_frame(conn, metadata)
                    report = json.loads(recv_frame(conn, deadline, f"the result of {peer}"))
                except OSError as err:
                    raise Fail(f"lost the connection to {peer} ({err}); see its log") from None
                except ValueError:
                    raise Fail(f"{peer} sent a malformed result; is it preflight.py pull?") from None
            if not isinstance(report, dict) or report.get("ok") is not True:
                detail = report.get("detail") if isinstance(report, dict) else report
                raise Fail(f"{peer} could not pull: {detail}")
            reports.append(f"{peer} in {report.get('detail', '?')}")
    return f"served {args.size_mib} MiB over {args.backend} to {args.peers} peer(s): {', '.join(reports)}"


def cmd_pull(args: argparse.Namespace) -> str:
    deadline = time.monotonic() + args.timeout
    host, _, port = args.peer.rpartition(":")
    if not host or not port.isdigit():
        raise Fail(f"--peer {args.peer} is not HOST:PORT; pass the serving pod's address and port")
    device, _ = preconditions(args.backend, args.device, 1)
    agent = make_agent(args.backend, "pull")
    buf = Buffer(args.size_mib << 20, device)
    register(agent, buf, args.backend)
    last: OSError | None = None
    while (left := deadline - time.monotonic()) > 0:  # the serving pod may still be starting: retry
        try:
            conn = socket.create_connection((host.strip("[]"), int(port)), timeout=min(5.0, left))
            break
        except OSError as err:
            last = err
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
    else:
        raise Fail(
            f"could not connect to {args.peer} within {args.timeout:g} s ({last}): run "
            "preflight.py serve there first and check that the port is reachable"
        )
    with conn:
        try:
            detail = pull_from(agent, buf, args, conn, deadline)
        except Fail as err:
            with contextlib.suppress(OSError):  # tell the server why, if it still listens
                send_frame(conn, json.dumps({"ok": False, "detail": str(err)}).encode())
            raise
        try:
            send_frame(conn, json.dumps({"ok": True, "detail": detail}).encode())
        except OSError as err:
            raise Fail(f"pulled the data but could not report to {args.peer} ({err}); see its log") from None
    return f"pulled {args.size_mib} MiB from {args.peer} over {args.backend} in {detail}"


def pull_from(agent: Any, buf: Buffer, args: argparse.Namespace, conn: socket.socket, deadline: float) -> str:
    try:
        header = json.loads(recv_frame(conn, deadline, "the peer's header"))
        descs = [(int(a), int(n), int(d)) for a, n, d in header["descs"]]
        backend, size, mem = header["backend"], int(header["size"]), str(header["mem"])
    except (ValueError, KeyError, TypeError):
        raise Fail(f"{args.peer} sent a malformed header: it is not preflight.py serve") from None
    if header.get("proto") != PROTO or backend != args.backend or size != buf.size:
        raise Fail(
            f"{args.peer} serves {size >> 20} MiB over {backend} (protocol {header.get('proto')}), this pull "
            f"wants {buf.size >> 20} MiB over {args.backend}: run both with the same --backend and --size-mib"
        )
    metadata = recv_frame(conn, deadline, "the peer's NIXL metadata")
    try:
        remote = agent.add_remote_agent(metadata)
        handle = agent.initialize_xfer(
            "READ",
            agent.get_xfer_descs(buf.descs(), buf.mem_type),
            agent.get_xfer_descs(descs, mem),
            remote,
            b"pdgate-preflight",
        )
        start = time.monotonic()
        state = agent.transfer(handle)
        while state == "PROC" and time.monotonic() < deadline:
            time.sleep(0.0005)
            state = agent.check_xfer_state(handle)
        took = time.monotonic() - start
    except Exception as err:
        raise Fail(
            f"NIXL {args.backend} READ from {args.peer} failed ({type(err).__name__}: {err}); "
            "check both pods' NIXL logs and that their network path is open"
        ) from None
    if state == "PROC":
        raise Fail(
            f"the NIXL {args.backend} READ from {args.peer} did not finish within {args.timeout:g} s; "
            "check the security group (EFA needs all traffic within the group) and the peer's log"
        )
    if state != "DONE":
        raise Fail(f"the NIXL {args.backend} READ from {args.peer} ended in state {state}; see the NIXL log above")
    if not buf.matches():
        raise Fail(f"the bytes read from {args.peer} do not match its pattern: the transfer corrupted data")
    return f"{took * 1e3:.1f} ms ({buf.size / max(took, 1e-9) / 1e9:.2f} GB/s)"


# -- the LMCache L2 store ---------------------------------------------------------------------------

L2_DEFAULT_PORTS = {"redis": 6379, "rediss": 6379, "valkey": 6379, "redis-sentinel": 26379, "lm": 65432}
L2_REDIS = ("redis", "valkey")  # plain-text RESP: PING must answer
L2_NOT_HOST_PORT = ("s3://",)  # buckets: reached through AWS's endpoints and IAM, not a port of ours


def l2_url_from_pod(env: dict[str, str] | None = None) -> tuple[str, str]:
    """The L2 URL LMCache uses in this pod and where it came from: LMCACHE_REMOTE_URL (applied over
    the file), else remote_url in LMCACHE_CONFIG_FILE."""
    env = dict(os.environ) if env is None else env
    if env.get("LMCACHE_REMOTE_URL", "").strip():
        return env["LMCACHE_REMOTE_URL"].strip(), "LMCACHE_REMOTE_URL"
    path = env.get("LMCACHE_CONFIG_FILE", "")
    if not path:
        raise Fail(
            "this pod has no LMCache config (neither LMCACHE_CONFIG_FILE nor LMCACHE_REMOTE_URL); "
            "run it in an engine that loads LMCache"
        )
    text = _read(path)
    if not text:
        raise Fail(f"cannot read LMCache's config {path}; check the lmcache ConfigMap mount")
    found = re.search(r"^remote_url:[ \t]*['\"]?([^'\"\s#]+)", text, re.M)
    if not found or found.group(1) in ("null", "~"):
        raise Fail(f"{path} has no remote_url: this pool's LMCache has no L2 store (lmcache.l2)")
    return found.group(1), path


def redact(url: str) -> str:
    """The URL without its password (user:pass@ or :pass@)."""
    return re.sub(r"//[^/@]*@", "//***@", url)


def l2_endpoints(url: str) -> tuple[str, list[tuple[str, int]]]:
    """(scheme, [(host, port), ...]) of a host:port L2 URL; Fail for a malformed one."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise Fail(f"remote_url {redact(url)} is not SCHEME://HOST:PORT; fix lmcache.l2.url")
    netloc = rest.split("/", 1)[0].rsplit("@", 1)[-1]
    endpoints = []
    for part in filter(None, netloc.split(",")):
        if part.startswith("["):  # [IPv6]:port
            host, _, tail = part[1:].partition("]")
            port = tail.removeprefix(":")
        else:
            host, _, port = part.partition(":")
        if not port and scheme not in L2_DEFAULT_PORTS:
            raise Fail(f"remote_url {redact(url)} names no port for {host}; add :PORT")
        if port and not port.isdigit():
            raise Fail(f"remote_url {redact(url)}: {port!r} is not a port number")
        endpoints.append((host, int(port) if port else L2_DEFAULT_PORTS[scheme]))
    if not endpoints or not all(host for host, _ in endpoints):
        raise Fail(f"remote_url {redact(url)} names no host; fix lmcache.l2.url")
    return scheme, endpoints


def reach(host: str, port: int, deadline: float) -> tuple[socket.socket, float]:
    """A TCP connection to host:port, retried until the deadline (the store may be restarting)."""
    last: OSError | None = None
    while (left := deadline - time.monotonic()) > 0:
        start = time.monotonic()
        try:
            return socket.create_connection((host, port), timeout=min(5.0, left)), time.monotonic() - start
        except OSError as err:  # socket.gaierror too: the Service may not exist (yet)
            last = err
        time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
    kind = "cannot resolve" if isinstance(last, socket.gaierror) else "cannot reach"
    raise Fail(f"{kind} {host}:{port} ({last or 'no time left'})")


def redis_ping(conn: socket.socket, deadline: float, where: str) -> str:
    """PING over RESP: +PONG, or an authentication error (reachable; LMCache's URL carries the password)."""
    conn.settimeout(max(0.1, deadline - time.monotonic()))
    try:
        conn.sendall(b"*1\r\n$4\r\nPING\r\n")
        reply = conn.recv(256).split(b"\r\n", 1)[0].decode("ascii", "replace")
    except OSError as err:
        raise Fail(f"{where} connected, but PING got no answer ({err})") from None
    if reply == "+PONG":
        return "PONG"
    if reply.startswith(("-NOAUTH", "-WRONGPASS", "-ERR AUTH")):
        return "asks for a password (LMCache's URL must carry it)"
    raise Fail(f"{where} connected, but answered PING with {reply[:60]!r}: not a Redis; check the port in remote_url")


def cmd_l2(args: argparse.Namespace) -> str:
    url, source = (args.url, "--url") if args.url else l2_url_from_pod()
    shown = redact(url)
    if url.startswith(L2_NOT_HOST_PORT):
        return f"LMCache L2 {shown} (from {source}) is not a host:port store: not checked"
    scheme, endpoints = l2_endpoints(url)
    start = time.monotonic()
    answers, failures = [], []
    for n, (host, port) in enumerate(endpoints, 1):
        deadline = start + args.timeout * n / len(endpoints)  # each endpoint its share of the timeout
        try:
            conn, took = reach(host, port, deadline)
            with conn:
                note = f"connected in {took * 1e3:.1f} ms"
                if scheme in L2_REDIS:
                    note += f", PING: {redis_ping(conn, deadline, f'{host}:{port}')}"
            answers.append(f"{host}:{port} {note}")
        except Fail as err:
            failures.append(str(err))
    # a Sentinel list works while any sentinel answers; every other store is one endpoint
    if failures and not (scheme == "redis-sentinel" and answers):
        raise Fail(
            f"LMCache L2 store {shown} (from {source}) within {args.timeout:g} s from {socket.gethostname()}: "
            f"{'; '.join(failures)}; check that the store's pod is Ready (the chart's: kubectl get pods -l "
            "app.kubernetes.io/component=lmcache-l2), its Service and port, and NetworkPolicies / security groups"
        )
    return f"LMCache L2 store {shown} (from {source}) answers {socket.gethostname()}: {', '.join(answers)}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    l2 = sub.add_parser("l2")
    l2.add_argument(
        "--url", default=None, help="default: the pod's LMCACHE_REMOTE_URL, else remote_url in LMCACHE_CONFIG_FILE"
    )
    l2.add_argument("--timeout", type=float, default=10.0, help="bound on the whole check, in seconds")
    for name in ("check", "serve", "pull"):
        s = sub.add_parser(name)
        s.add_argument("--backend", required=True, choices=["LIBFABRIC", "UCX"])
        s.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda if a GPU is visible")
        if name == "check":
            s.add_argument("--efa-devices", type=int, default=1, help="EFA devices the pod must see (LIBFABRIC)")
            continue
        s.add_argument("--size-mib", type=int, default=64)
        s.add_argument("--timeout", type=float, default=120.0, help="bound on the whole run, in seconds")
        if name == "serve":
            s.add_argument("--port", type=int, required=True)
            s.add_argument("--host", default="0.0.0.0")
            s.add_argument("--peers", type=int, default=1)
        else:
            s.add_argument("--peer", required=True, help="HOST:PORT of preflight.py serve")
    args = p.parse_args(argv)
    if getattr(args, "size_mib", 1) < 1 or getattr(args, "peers", 1) < 1:
        p.error("--size-mib and --peers must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run = {"check": cmd_check, "serve": cmd_serve, "pull": cmd_pull, "l2": cmd_l2}[args.command]
    try:
        print(f"preflight ok: {run(args)}", flush=True)
        return 0
    except Fail as err:
        print(f"preflight FAILED: {err}", flush=True)
    except Exception as err:  # one line even for the unexpected
        print(f"preflight FAILED: unexpected {type(err).__name__}: {err}; rerun with NIXL_LOG_LEVEL=DEBUG", flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
