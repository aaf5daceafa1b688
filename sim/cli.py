"""Command line of the simulator: ``python -m sim ...`` or ``pdgate sim ...``."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

import orjson

from engine_model.adapters import MAX_LORA_RANKS, AdapterLoadError, check_adapter, parse_lora_module
from engine_model.config import HASH_ALGOS, KV_LOAD_FAILURE_POLICIES, ROLES, SimConfig
from engine_model.faults import DropLogFilter
from engine_model.kv_events import KVEventsConfig
from engine_model.oneline import Help, Parser
from engine_model.profile import available, engine_settings

DESCRIPTION = """\
A vLLM 0.32-compatible engine simulator on CPU: the OpenAI API, /metrics, /sim/state and the
NIXL-style P/D hand-over, as a real engine started with the same flags would serve them. Every
timing flag at 0 (the default) makes an instant engine; --profile sets them from a calibrated
model of a GPU node, and flags given explicitly override it."""

EPILOG = """\
examples:
  pdgate sim --port 8100 --role prefill --profile fast     # a prefill engine
  pdgate sim --port 8200 --role decode --profile fast      # a decode engine
  pdgate sim --profile llama-3.3-70b-tp8-h100 --time-scale 0.1   # a 70B node's timings, 10x faster
  curl localhost:8200/sim/state                            # what the engine holds and runs"""


def build_parser(prog: str | None = None) -> Parser:
    d = SimConfig.__dataclass_fields__
    p = Parser(prog=prog, description=DESCRIPTION, epilog=EPILOG, formatter_class=Help)
    p.add_argument("--role", choices=ROLES, default="both", help="which P/D legs this engine accepts")
    p.add_argument("--host", default="127.0.0.1", help="HTTP (and side-channel) bind address")
    p.add_argument("--port", type=int, default=8000, help="HTTP port")
    p.add_argument("--model", default="sim", help="served model name")
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="FOLDER",
        help="Hugging Face tokenizer folder; without it a token is 4 bytes of UTF-8 (ceil(len/4))",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=d["max_model_len"].default,
        help="context length the engine serves (vLLM's flag; prompt + output tokens)",
    )
    p.add_argument("--block-size", type=int, default=d["block_size"].default, help="tokens per KV block")
    p.add_argument(
        "--num-gpu-blocks", type=int, default=d["num_gpu_blocks"].default, help="KV blocks (incl. null block)"
    )
    p.add_argument(
        "--max-num-seqs", type=int, default=d["max_num_seqs"].default, help="running requests; beyond, they wait"
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=d["max_num_batched_tokens"].default,
        help="token budget of one engine step (chunked prefill)",
    )
    p.add_argument("--prefill-time-per-token", type=float, default=0.0, help="seconds of step time per prompt token")
    p.add_argument(
        "--decode-time-per-token", type=float, default=0.0, help="seconds per decode step (inter-token latency)"
    )
    p.add_argument(
        "--kv-transfer-time-per-token", type=float, default=0.0, help="seconds per pulled prompt token (decode side)"
    )
    p.add_argument(
        "--step-base-time", type=float, default=0.0, help="seconds every engine step costs (weights read once)"
    )
    p.add_argument("--decode-time-per-seq", type=float, default=0.0, help="seconds of step time per decoding sequence")
    p.add_argument(
        "--context-time-per-token",
        type=float,
        default=0.0,
        help="seconds of step time per KV token the step's decoding sequences attend to",
    )
    p.add_argument(
        "--kv-bandwidth-gbps",
        type=float,
        default=0.0,
        help="KV pull link in Gbit/s (with --kv-bytes-per-token; 0: no bandwidth term)",
    )
    p.add_argument(
        "--prefill-attention-time",
        type=float,
        default=0.0,
        help="seconds of step time per (prefill chunk token x token it attends to): later chunks cost more",
    )
    p.add_argument("--kv-transfer-latency", type=float, default=0.0, help="fixed seconds per KV hand-over")
    p.add_argument(
        "--kv-transfer-time-per-block", type=float, default=0.0, help="seconds per pulled KV block (descriptors)"
    )
    p.add_argument(
        "--profile",
        default=None,
        metavar="NAME|FILE",
        help="engine profile: a bundled name (" + ", ".join(available()) + ") or a YAML file; "
        "flags given explicitly override it (see engine_model/profiles/; without it: the timing flags, 0 = instant)",
    )
    p.add_argument(
        "--profile-end",
        choices=("low", "high"),
        default=None,
        help="put every uncertain setting of the profile (its ranges) at this end (without it: their central values)",
    )
    p.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="multiply every simulated duration (steps, KV pulls) by this: 0.1 runs 10x faster than real time",
    )
    p.add_argument("--kv-host", default=None, help="host advertised as remote_host (default: --host)")
    p.add_argument("--kv-port", type=int, default=0, help="side-channel port (0: pick a free one)")
    p.add_argument(
        "--kv-expiry", type=float, default=d["kv_expiry"].default, help="seconds prefill blocks wait for a pull"
    )
    p.add_argument(
        "--kv-handshake-timeout",
        type=float,
        default=d["kv_handshake_timeout"].default,
        help="seconds a decode leg keeps trying an unreachable side channel",
    )
    p.add_argument(
        "--kv-bytes-per-token",
        type=int,
        default=d["kv_bytes_per_token"].default,
        help="KV size per token for vllm:nixl_bytes_transferred",
    )
    p.add_argument(
        "--default-max-tokens",
        type=int,
        default=d["default_max_tokens"].default,
        help="output tokens of a request that gives no max_tokens (vLLM: 16 for completions)",
    )
    p.add_argument("--engine-id", default=None, help="NIXL engine id (default: random uuid4)")
    p.add_argument(
        "--enable-request-id-headers",
        action="store_true",
        help="echo X-Request-Id on responses (vLLM's flag of the same name)",
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="automatic prefix caching of full KV blocks (vLLM's flag)",
    )
    p.add_argument(
        "--prefix-caching-hash-algo",
        choices=HASH_ALGOS,
        default="sha256",
        help="block hash algorithm (vLLM's flag); the NONE_HASH seed is PYTHONHASHSEED when set",
    )
    p.add_argument(
        "--kv-events-config",
        default=None,
        metavar="JSON",
        help='KV cache events (without it: none), vLLM\'s JSON: {"enable_kv_cache_events": true, "publisher": "zmq", '
        '"endpoint": "tcp://*:5557", "replay_endpoint": null, "buffer_steps": 10000, "hwm": 100000, '
        '"max_queue_size": 100000, "topic": ""}',
    )
    p.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="usage.prompt_tokens_details with cached_tokens (vLLM's flag)",
    )
    p.add_argument(
        "--kv-load-failure-policy",
        choices=KV_LOAD_FAILURE_POLICIES,
        default="fail",
        help="a decode leg whose KV pull fails: fail it (HTTP 500) or recompute the prompt locally "
        "(vLLM: kv_load_failure_policy in --kv-transfer-config)",
    )
    _tier_flags(p, d)
    _lora_flags(p, d)
    p.add_argument(
        "--faults",
        default=None,
        metavar="JSON",
        help="faults injected from the start (without it: none), the JSON of PUT /sim/faults: "
        '{"seed": 1, "error": {"status": 500, '
        '"on": ["decode"], "count": 1, "probability": 1.0}, "hang": {...}, "slow": {"first_byte_delay": 1, '
        '"chunk_delay": 0.1}, "drop": {"after_chunks": 2}, "kv_refuse": {"count": 1}} (see sim/README.md)',
    )
    p.add_argument(
        "--log-level",
        default="warning",
        choices=["debug", "info", "warning", "error"],
        help="the engine's own log lines on stderr",
    )
    return p


def _tier_flags(p: Parser, d: dict[str, Any]) -> None:
    """The offload tiers' flags (engine_model/tiers.py; sim/README.md, "KV offload tiers")."""
    p.add_argument(
        "--cpu-blocks",
        type=int,
        default=0,
        help="L1: KV blocks kept in host memory (vLLM's CPU offloading, LRU; 0: off)",
    )
    p.add_argument(
        "--l1-load-time-per-token",
        type=float,
        default=0.0,
        help="seconds to copy one token's KV from the L1 to the GPU (an L1 hit)",
    )
    p.add_argument(
        "--l2-url",
        default=None,
        metavar="redis://HOST:PORT/DB",
        help="shared L2: a Redis store of block hashes, shared by the engines given the same URL and prefix "
        "(needs --cpu-blocks; unreachable: the engine serves without it)",
    )
    p.add_argument(
        "--l2-key-prefix", default=d["l2_key_prefix"].default, help="the L2's Redis keys (one prefix per shared store)"
    )
    p.add_argument("--l2-blocks", type=int, default=d["l2_blocks"].default, help="the L2's capacity in blocks (LRU)")
    p.add_argument("--l2-latency", type=float, default=0.0, help="fixed seconds of one L2 load or upload")
    p.add_argument(
        "--l2-bandwidth-gbps",
        type=float,
        default=0.0,
        help="L2 link in Gbit/s (with --kv-bytes-per-token; 0: no bandwidth term)",
    )
    p.add_argument("--l2-timeout", type=float, default=d["l2_timeout"].default, help="seconds one Redis call may take")
    p.add_argument(
        "--self-describing-kv-events",
        action="store_true",
        help="tier events carry each block's tokens and parent hash (vLLM's kv_connector_extra_config "
        "self_describing_kv_events; without it: vLLM's placeholder payload)",
    )


def _lora_flags(p: Parser, d: dict[str, Any]) -> None:
    """LoRA adapters, vLLM's flags (engine_model/adapters.py; sim/README.md, "LoRA adapters")."""
    p.add_argument(
        "--enable-lora",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="serve LoRA adapters (vLLM's flag; needed by --lora-modules and the runtime load route)",
    )
    p.add_argument(
        "--max-loras", type=int, default=d["max_loras"].default, help="distinct adapters in one running batch"
    )
    p.add_argument(
        "--max-cpu-loras",
        type=int,
        default=None,
        help="adapters kept loaded, least recently used evicted (default: --max-loras; must be >= it)",
    )
    p.add_argument(
        "--max-lora-rank",
        type=int,
        choices=MAX_LORA_RANKS,
        default=d["max_lora_rank"].default,
        help="largest adapter rank accepted (adapter_config.json's r)",
    )
    p.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="ITEM",
        help='adapters loaded at start-up: name=path or JSON {"name": ..., "path": ..., "base_model_name": ...} '
        "(several after the flag); the path must be a folder",
    )
    p.add_argument(
        "--lora-load-time",
        type=float,
        default=d["lora_load_time"].default,
        help="sim knob: seconds to load an adapter that is not among the --max-cpu-loras loaded ones "
        "(in the step that first needs it; x --time-scale)",
    )


def _explicit(argv: list[str] | None) -> set[str]:
    """Destinations given on the command line (they override a profile's settings)."""
    parser = build_parser()
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(argv)))


def config_from_args(args: argparse.Namespace, argv: list[str] | None = None) -> SimConfig:
    kw = {k: v for k, v in vars(args).items() if v is not None}
    tokenizer = kw.get("tokenizer")
    if tokenizer and tokenizer.startswith(("/", ".", "~")) and not Path(tokenizer).expanduser().is_dir():
        # a path, not a hub name: said now, not after transformers' import and its repo-id complaint
        raise ValueError(f"--tokenizer {tokenizer}: no such folder")
    end = kw.pop("profile_end", None)
    if end and not kw.get("profile"):
        raise ValueError("--profile-end needs --profile")
    if kw.get("profile"):
        if argv is not None:
            explicit = _explicit(argv)
        else:  # parsed elsewhere: a value other than the flag's default counts as given
            defaults = vars(build_parser().parse_args([]))
            explicit = {k for k, v in vars(args).items() if v != defaults.get(k)}
        settings = engine_settings(kw["profile"], end=end)
        for k, v in settings.items():
            if k not in explicit:
                kw[k] = v
        kw["profile"] = settings["profile"]  # NAME@low / NAME@high: what /sim/state reports
    if "kv_events_config" in kw:
        kw["kv_events_config"] = KVEventsConfig.from_json(kw["kv_events_config"])
    if "faults" in kw:
        try:
            kw["faults"] = orjson.loads(kw["faults"])
        except orjson.JSONDecodeError as e:
            raise ValueError(f"--faults is not valid JSON: {e}") from e
    # vLLM mounts its development routes (/reset_prefix_cache, ...) only with this variable.
    kw["server_dev_mode"] = os.environ.get("VLLM_SERVER_DEV_MODE", "0") not in ("", "0", "false", "False")
    # ... and its LoRA load/unload routes only with this one (vllm/envs.py:1206-1209).
    runtime_lora = os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0").strip().lower() in ("1", "true")
    kw["allow_runtime_lora_updating"] = runtime_lora
    kw["lora_modules"] = [parse_lora_module(item) for item in kw.get("lora_modules") or [] if item]
    cfg = SimConfig(**kw)
    seen: set[str] = set()
    for mod in cfg.lora_modules:  # what the start-up load would refuse, said now in one line
        if mod.name in seen or mod.name == cfg.model:
            why = "is given twice" if mod.name in seen else "conflicts with a served base model"
            raise ValueError(f"--lora-modules: the lora adapter '{mod.name}' {why}")
        seen.add(mod.name)
        try:
            check_adapter(mod.name, mod.path, cfg.max_lora_rank)
        except AdapterLoadError as e:
            raise ValueError(f"--lora-modules {mod.name}={mod.path}: {e.message}") from None
    return cfg


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Parse ``argv`` (default: sys.argv[1:]) and serve until interrupted."""
    if prog is None:
        prog = "python -m sim" if sys.argv[0].endswith(os.path.join("sim", "__main__.py")) else "pdgate sim"
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    try:
        cfg = config_from_args(args, argv)
    except ValueError as e:
        parser.fail(str(e))
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("uvicorn.error").addFilter(DropLogFilter())  # an injected drop is no server error

    import uvicorn

    from sim.app import create_app

    try:
        app = create_app(cfg)  # loads the tokenizer
    except (OSError, ValueError, ImportError) as err:  # what transformers raises for a tokenizer it cannot load
        if not cfg.tokenizer:
            raise
        cause = str(err).strip().splitlines()[0] if str(err).strip() else ""
        parser.fail(f"--tokenizer {cfg.tokenizer}: cannot load ({type(err).__name__}: {cause})")
    uvicorn.run(
        app,
        host=cfg.host,
        port=cfg.port,
        loop="uvloop",
        http="httptools",
        access_log=False,
        log_level=cfg.log_level,
        lifespan="on",
        timeout_graceful_shutdown=2,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
