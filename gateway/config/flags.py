"""``pdgate serve`` from flags alone: the config file that ``--prefill``/``--decode``/``--model`` describe.

Peers (vllm-router, SGLang's router) start P/D from flags, and so does pdgate: the flags become
the equivalent YAML (``--print-config`` shows it, to graduate to a file), which is then served as
any file is, through the one loader and validator. No second code path, no second set of defaults.

An engine is ``URL [KV_EVENTS]``: its base URL and, optionally, where it publishes its KV cache
events (vLLM ``--kv-events-config``): a ZMQ address, or a bare port meaning ``tcp://<URL's host>:PORT``.
"""

from __future__ import annotations

import argparse
from typing import Any
from urllib.parse import urlsplit

import httpx
import yaml
from pydantic import ValidationError

from gateway.config import GatewayConfig
from gateway.config.fields import check_url

PROBE_TIMEOUT_S = 5.0  # an engine's /v1/models, asked once at startup when --max-model-len is not given
DEFAULT_THRESHOLD = 4096

ENGINE_FLAGS = (
    "prefill",
    "decode",
    "model",
    "tokenizer",
    "max_model_len",
    "threshold",
    "hash_seed",
    "workers",
    "debug_headers",
    "admin_token_env",
    "api_keys_file",
    "print_config",
)


class FlagError(ValueError):
    """Flags that describe no valid config: one line for the terminal, naming the flag."""


def add_flags(serve: argparse.ArgumentParser) -> None:
    """The flags that describe a config without a file (``--config`` excludes them)."""
    group = serve.add_argument_group(
        "without a config file", "engines and model from flags; --print-config shows the YAML they make"
    )
    group.add_argument(
        "--prefill",
        nargs="+",
        action="append",
        metavar=("URL", "KV_EVENTS"),
        help="a prefill engine (repeat the flag for more); KV_EVENTS: its KV event publisher, "
        "tcp://HOST:PORT or a port on the URL's host",
    )
    group.add_argument(
        "--decode",
        nargs="+",
        action="append",
        metavar=("URL", "KV_EVENTS"),
        help="a decode engine (repeat the flag for more), as --prefill",
    )
    group.add_argument("--model", help="the model name clients send (the engines' served model name)")
    group.add_argument("--tokenizer", help="its tokenizer: a local folder or a hub name (default: --model)")
    group.add_argument(
        "--max-model-len", type=int, help="the engines' --max-model-len (default: asked of the engines' /v1/models)"
    )
    group.add_argument(
        "--threshold",
        type=int,
        help="prefill -> decode from this many uncached prompt tokens, else direct (default 4096)",
    )
    group.add_argument("--hash-seed", help="the engines' PYTHONHASHSEED: needed to follow their KV events")
    group.add_argument("--workers", type=int, help="worker processes (default: one per core)")
    group.add_argument(
        "--debug-headers", action="store_true", help="x-pdgate-route on every response: why the request took its path"
    )
    group.add_argument(
        "--admin-token-env",
        metavar="VAR",
        help="environment variable holding the token for /admin/config and /debug/route",
    )
    group.add_argument("--api-keys-file", metavar="FILE", help="clients' API keys, one per line (default: open)")
    group.add_argument("--print-config", action="store_true", help="print the YAML these flags make and exit")


def wants_flags(args: argparse.Namespace) -> bool:
    """Whether any flag of the file-less form was given (its defaults do not count)."""
    return any(getattr(args, name) not in (None, False) for name in ENGINE_FLAGS)


def _endpoint(values: list[str], flag: str) -> dict[str, Any] | str:
    if len(values) > 2:
        raise FlagError(
            f"--{flag} takes a URL and at most a KV events address, got {len(values)} values "
            f"(repeat --{flag} for each engine)"
        )
    try:
        url = check_url(values[0])
    except ValueError as err:
        raise FlagError(f"--{flag}: {err}") from None
    if len(values) == 1:
        return url
    events = values[1]
    if events.isdigit():
        host = urlsplit(url).hostname or ""
        events = f"tcp://[{host}]:{events}" if ":" in host else f"tcp://{host}:{events}"
    elif not events.startswith(("tcp://", "ipc://")):
        raise FlagError(f"--{flag} {values[0]}: KV events {events!r} must be tcp://HOST:PORT, ipc://PATH or a port")
    return {"url": url, "kv_events": events}


def config_from_flags(args: argparse.Namespace, probe: Any = None) -> dict[str, Any]:
    """The config the flags describe, as the YAML file's mapping. ``probe(urls, model)`` answers
    the engines' context length when ``--max-model-len`` is not given (default: their /v1/models)."""
    if not args.decode:
        raise FlagError("without --config, give the engines and the model: --decode URL [--prefill URL] --model NAME")
    if not args.model:
        raise FlagError("--model NAME is needed with --decode (the model name clients send)")
    prefill = [_endpoint(v, "prefill") for v in args.prefill or []]
    decode = [_endpoint(v, "decode") for v in args.decode]
    max_len = args.max_model_len
    if max_len is None:
        urls = [e if isinstance(e, str) else e["url"] for e in decode + prefill]
        max_len = (probe or max_model_len_of)(urls, args.model)
    cfg: dict[str, Any] = {}
    server = {k: v for k, v in (("host", args.host), ("port", args.port), ("workers", args.workers)) if v is not None}
    if server:
        cfg["server"] = server
    cfg["models"] = [{"name": args.model, "tokenizer": args.tokenizer or args.model, "max_model_len": max_len}]
    cfg["pools"] = {"prefill": {"endpoints": prefill}, "decode": {"endpoints": decode}}
    routing: dict[str, Any] = {
        "decider": {
            "name": "token_threshold",
            "threshold": DEFAULT_THRESHOLD if args.threshold is None else args.threshold,
        }
    }
    if args.debug_headers:
        routing["debug_headers"] = True
    if args.hash_seed is not None:
        routing["prefix"] = {"hash_seed": args.hash_seed}
    cfg["routing"] = routing
    if args.admin_token_env:
        cfg["admin"] = {"token_env": args.admin_token_env}
    if args.api_keys_file:
        cfg["auth"] = {"api_keys_file": args.api_keys_file}
    return cfg


# Where each flag lands in the config: a validation error there is told by the flag's name.
FLAG_OF = {
    "models.0.name": "--model",
    "models.0.tokenizer": "--tokenizer",
    "models.0.max_model_len": "--max-model-len",
    "routing.decider.threshold": "--threshold",
    "routing.prefix.hash_seed": "--hash-seed",
    "server.port": "--port",
    "server.host": "--host",
    "server.workers": "--workers",
    "pools.prefill": "--prefill",
    "pools.decode": "--decode",
    "admin": "--admin-token-env",
    "auth": "--api-keys-file",
}


def check(cfg: dict[str, Any]) -> GatewayConfig:
    """Validate what the flags made with the gateway's own validator; a failure names the flag."""
    try:
        return GatewayConfig.model_validate(cfg)
    except ValidationError as err:
        said = []
        for e in err.errors():
            where = ".".join(str(p) for p in e["loc"])
            flag = next((f for key, f in FLAG_OF.items() if where == key or where.startswith(key + ".")), where)
            said.append(f"{flag}: {e['msg'].removeprefix('Value error, ')}")
        raise FlagError("; ".join(said)) from None


def in_flags_words(text: str, path: str) -> str:
    """A message about the file the flags made, told as ``pdgate serve: --flag: ...``."""
    if path:
        text = text.replace(f"{path}: ", "pdgate serve: ", 1)
    for where, flag in FLAG_OF.items():
        head, _, rest = where.partition(".")
        yaml_path = (
            f"{head}[{rest.split('.')[0]}]" + "".join(f".{p}" for p in rest.split(".")[1:])
            if rest[:1].isdigit()
            else where
        )
        text = text.replace(f"{yaml_path}:", f"{flag}:").replace(f"{yaml_path}[", f"{flag}[")
    return text


def render(cfg: dict[str, Any]) -> str:
    return "# made by pdgate serve's flags (--print-config)\n" + yaml.safe_dump(cfg, sort_keys=False)


def max_model_len_of(urls: list[str], model: str, timeout_s: float = PROBE_TIMEOUT_S) -> int:
    """The context length the engines serve ``model`` with, from the first that answers its
    /v1/models (vLLM lists ``max_model_len`` there). The gateway needs it before any request:
    it refuses prompts longer than the context, as the engine would, without wasting a prefill."""
    seen: list[str] = []
    for url in urls:
        try:
            r = httpx.get(f"{url}/v1/models", timeout=timeout_s)
            r.raise_for_status()
            body = r.json()
        except httpx.TransportError:
            seen.append(f"{url} unreachable")
            continue
        except (httpx.HTTPError, ValueError) as err:
            seen.append(f"{url}: {type(err).__name__}")
            continue
        # Valid JSON is not yet a model list: check its shape before reading it, so a wrongly
        # typed answer ({"data": null}, an id that is a list) is one more engine that did not tell.
        listed = body.get("data") if isinstance(body, dict) else None
        if not isinstance(listed, list):
            seen.append(f"{url}: not a model list")
            continue
        served = {m["id"]: m for m in listed if isinstance(m, dict) and isinstance(m.get("id"), str)}
        if model not in served:
            seen.append(f"{url} serves {sorted(served)}")
            continue
        length = served[model].get("max_model_len")
        if isinstance(length, int) and not isinstance(length, bool) and length > 0:
            return length
        seen.append(f"{url} does not say its max_model_len")
    raise FlagError(
        f"--max-model-len not given and no engine told it for model {model!r} "
        f"({'; '.join(seen)}): pass --max-model-len N"
    )
