"""``pdgate``: serve the gateway, run the local demo, run one simulated engine, check a config."""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import os
import signal
import sys
import tempfile
from collections.abc import Callable
from typing import TYPE_CHECKING

from gateway.config import ConfigError, GatewayConfig, PoolConfig, access_switched_off
from gateway.config.flags import add_flags
from gateway.tokenization import frameworks
from gateway.tokenization.hub import NO_TOKENIZERS_HINT, TokenizerUnavailable

if TYPE_CHECKING:
    from gateway.tokenization.tokenizer import Tokenizers


def load_tokenizers(cfg: GatewayConfig) -> Tokenizers:
    """Every model's tokenizer, as the gateway serves with them; raises ValueError naming the
    model's ``tokenizer`` key and the cause (one line, no traceback)."""
    from gateway.tokenization.tokenizer import ModelTokenizer, Tokenizers

    loaded = []
    for i, model in enumerate(cfg.models):
        try:
            loaded.append(ModelTokenizer.load(cfg.tokenizer_model(model)))  # a template file as pinned
        except TokenizerUnavailable as err:  # a hub name the hub cannot give here: what to do, said
            raise TokenizerUnavailable(f"models[{i}].tokenizer: cannot load {model.tokenizer!r}: {err}") from None
        except Exception as err:  # whatever transformers raises for a missing or broken tokenizer
            cause = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ValueError(
                f"models[{i}].tokenizer: cannot load {model.tokenizer!r} ({type(err).__name__}: {cause})"
            ) from None
    return Tokenizers(loaded, cfg.tokenizer)


def _serve(args: argparse.Namespace) -> int:
    """``--config FILE``, or the file that the engine flags describe (gateway/config/flags.py),
    written to a private folder that lives as long as the process."""
    from gateway.cluster.workers import worker_count
    from gateway.config.flags import check, config_from_flags, in_flags_words, render, wants_flags

    if args.config is not None:
        if wants_flags(args):
            print(
                "pdgate serve: give either --config FILE or the engine flags (--decode URL --model NAME ...), not both",
                file=sys.stderr,
            )
            return 2
        return _serve_file(args)
    try:
        cfg = config_from_flags(args)
        parsed = check(cfg)
        text = render(cfg)
        if not args.print_config and worker_count(parsed) > 1:  # workers load it each, and say failures apart
            load_tokenizers(parsed).close()
    except ValueError as err:  # FlagError, or a tokenizer that cannot load: in the flags' words
        print(f"pdgate serve: {in_flags_words(str(err), '')}", file=sys.stderr)
        return 2
    if args.print_config:
        print(text, end="")
        return 0
    # uvicorn re-raises the SIGTERM it handled once it has shut down, which would end the process
    # before the folder below is removed: here that signal ends it as an exception instead.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    with tempfile.TemporaryDirectory(prefix="pdgate-serve-") as folder:
        args.config = os.path.join(folder, "flags.yaml")
        with open(args.config, "w", encoding="utf-8") as f:
            f.write(text)
        args.host = args.port = None  # they are in the file already
        args.from_flags = True
        return _serve_file(args)


def _say(args: argparse.Namespace, text: str) -> None:
    """An error about the config, on stderr: in the flags' words when the flags made the config."""
    if getattr(args, "from_flags", False):
        from gateway.config.flags import in_flags_words

        text = in_flags_words(text, args.config)
    print(text, file=sys.stderr)


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _epp(args: argparse.Namespace) -> int:
    """``pdgate epp``: the gateway as Envoy's endpoint picker (gateway/epp/, docs/epp.md)."""
    args.epp = True
    return _serve_file(args)


def _as_picker(cfg: GatewayConfig, grpc_port: int | None) -> GatewayConfig:
    """``cfg`` for ``pdgate epp``: the picker on, one process (Envoy keeps one HTTP/2 connection
    to a picker, so worker processes would not share its load: run replicas), and engines Envoy can
    route to by address. Raises ValueError naming what does not fit."""
    from gateway.epp.protocol import is_ip_endpoint

    named = [("decode", e.url) for e in cfg.pools.decode.endpoints]
    if cfg.epp.prefill == "header":  # llm-d's sidecar is given the prefill engine's address
        named += [("prefill", e.url) for e in cfg.pools.prefill.endpoints]
    for pool, url in named:
        if not is_ip_endpoint(url):
            raise ValueError(
                f"pools.{pool}: {url} is not an IP address; Envoy routes to the picker's choice by address "
                "(use the engines' addresses, or discovery, which gives pod IPs)"
            )
    epp = {"enabled": True} if grpc_port is None else {"enabled": True, "port": grpc_port}
    return cfg.model_copy(
        update={"epp": cfg.epp.model_copy(update=epp), "server": cfg.server.model_copy(update={"workers": 1})}
    )


def _serve_file(args: argparse.Namespace) -> int:
    from gateway.cluster.workers import serve as serve_workers
    from gateway.cluster.workers import worker_count
    from gateway.config.reload import read_snapshot
    from gateway.http.app import create_app
    from gateway.http.reconfigure import validate
    from gateway.http.uvicorn_server import make_server
    from gateway.ops.gcpolicy import Collector

    try:  # the config and the files it names, read once: every worker starts from this version
        snapshot = read_snapshot(args.config)
        cfg = snapshot.load(args.config)
    except OSError as err:
        print(f"{args.config}: cannot read ({err.strerror})", file=sys.stderr)
        return 2
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 2
    if getattr(args, "epp", False):
        try:
            cfg = _as_picker(cfg, args.grpc_port)
        except ValueError as err:
            print(f"{args.config}: {err}", file=sys.stderr)
            return 2
    host = args.host or cfg.server.host
    port = args.port if args.port is not None else cfg.server.port
    # Given on the command line, they win over the file's for as long as the process runs (reloads
    # included): the running config says them. Else a reload that changes the file's says it is
    # for the next restart.
    listen = (host, port) if args.host or args.port is not None else None
    level = cfg.server.log_level.upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("watchfiles").setLevel(logging.WARNING)  # it logs every file event at INFO
    workers = worker_count(cfg)
    if workers > 1:  # each loads the tokenizers; a failure comes back as one line
        try:
            validate(cfg)  # what would fail in every worker fails here, once
        except ValueError as err:
            _say(args, f"{args.config}: {err}")
            return 2
        return serve_workers(cfg, args.config, snapshot.text, host, port, workers, listen=listen)
    try:
        tokenizers = load_tokenizers(cfg)  # here, not at startup: a missing tokenizer is one line, not a traceback
        server = make_server(
            cfg,
            lambda connections: create_app(
                cfg,
                tokenizers,
                config_path=args.config,
                config_version=snapshot.version,
                connections=connections,
                listen=listen,
                collector=Collector(cfg.server.gc_young_threshold),
            ),
            host=host,
            port=port,
            log_level=cfg.server.log_level.lower(),
        )
    except ValueError as err:  # e.g. an unknown policy name, a tokenizer that cannot load
        _say(args, f"{args.config}: {err}")
        return 2
    server.run()
    if not server.started:
        return 3  # as uvicorn.run exits when startup fails
    return 0


def _load(path: str) -> GatewayConfig:
    """The config at ``path`` with the files it names, as serve and a reload read them."""
    from gateway.config.reload import read_snapshot

    try:
        return read_snapshot(path).load(path)
    except OSError as err:
        raise ConfigError(f"{path}: cannot read ({err.strerror})") from None


def _check(args: argparse.Namespace) -> int:
    from gateway.http.reconfigure import validate

    switched_off: list[str] = []
    try:
        cfg = _load(args.config)
        validate(cfg)
        if args.previous:  # the change from the running config, as a reload would judge it
            previous = _load(args.previous)
            switched_off = access_switched_off(previous, cfg)
        if not args.no_tokenizers:
            load_tokenizers(cfg).close()
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 1
    except ValueError as err:
        hint = NO_TOKENIZERS_HINT if isinstance(err, TokenizerUnavailable) else ""
        print(f"{args.config}: {err}{hint}", file=sys.stderr)
        return 1
    for what in switched_off:  # said on purpose (auth.disabled, admin.disabled), still worth a look
        print(f"{args.config}: warning: switches off {what} (said on purpose)", file=sys.stderr)

    def pool(p: PoolConfig) -> str:
        found = f" + discovery ({p.discovery.label_selector})" if p.discovery else ""
        return f"{len(p.endpoints)}{found}"

    keys = "" if cfg.auth.configured else "; no API keys: every client may call it"
    print(
        f"{args.config}: OK ({len(cfg.models)} model(s), {pool(cfg.pools.prefill)} prefill and "
        f"{pool(cfg.pools.decode)} decode endpoint(s){keys})"
    )
    return 0


def _demo(args: argparse.Namespace) -> int:
    from gateway.demo import run_demo

    return run_demo(args)


def _added_command(name: str) -> Callable[[list[str]], int]:
    """A command another installed package adds to ``pdgate`` (entry point group ``pdgate.commands``):
    ``pdgate sim`` is the simulator's own CLI, so the gateway never imports the simulator. A missing
    one (a source tree used without ``pip install``) exits with one line."""
    for entry in importlib.metadata.entry_points(group="pdgate.commands", name=name):
        command: Callable[[list[str]], int] = entry.load()
        return command
    raise SystemExit(f"pdgate {name}: not installed (install the project: pip install -e .)")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # The gateway only tokenizes: transformers' "PyTorch was not found" advice at import is noise.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    frameworks.keep_out()  # no command of pdgate runs a model: no PyTorch (~700 MB) in its processes
    if argv[:1] == ["sim"]:  # the simulator owns its flags
        return _added_command("sim")(argv[1:])
    if argv[:1] == ["plan"]:  # so does the planner
        from engine_model.plan_cli import main as plan_main

        return plan_main(argv[1:])

    parser = argparse.ArgumentParser(prog="pdgate", description="Disaggregated prefill/decode gateway for vLLM")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser(
        "serve",
        help="run the gateway",
        description="Run the gateway from a YAML config file (hot-reloaded), or from flags alone: "
        "pdgate serve --prefill URL --decode URL --model NAME [--tokenizer PATH].",
    )
    serve.add_argument("--config", help="YAML config file")
    serve.add_argument("--host", help="override server.host")
    serve.add_argument("--port", type=int, help="override server.port")
    add_flags(serve)
    serve.set_defaults(func=_serve)

    epp = sub.add_parser(
        "epp",
        help="run the gateway as Envoy's endpoint picker (Gateway API Inference Extension)",
        description="Run the gateway as an endpoint picker: Envoy (or a Gateway API implementation) asks it over "
        "ext_proc which engine serves each request and relays the bytes itself; the HTTP port keeps /ready, "
        "/metrics, /debug/route, /admin and the OpenAI routes (a pdgate relay for requests that need one). "
        "See docs/epp.md.",
    )
    epp.add_argument("--config", required=True, help="YAML config file (the same as serve's)")
    epp.add_argument("--host", help="override server.host (the HTTP port)")
    epp.add_argument("--port", type=int, help="override server.port (the HTTP port)")
    epp.add_argument("--grpc-port", type=int, help="override epp.port (ext_proc, access log, health)")
    epp.set_defaults(func=_epp)

    demo = sub.add_parser(
        "demo",
        help="gateway + simulated prefill and decode engines on this machine",
        description="The whole system on this machine, no GPU: simulated prefill and decode engines (the "
        "vLLM-compatible simulator in sim/) behind a real gateway. Prints curl commands to try, an admin token "
        "for /debug/route and /admin/config (made for this run), and where the config and logs are; responses "
        "say their path and why (x-pdgate-path, x-pdgate-route). Ctrl-C stops every process it started.",
    )
    demo.add_argument("--port", type=int, default=8000, help="the gateway's port (default 8000)")
    demo.add_argument("--host", default="127.0.0.1", help="the gateway's address (default 127.0.0.1)")
    demo.add_argument("--prefill", type=int, default=2, help="simulated prefill engines (default 2)")
    demo.add_argument("--decode", type=int, default=2, help="simulated decode engines (default 2)")
    demo.add_argument(
        "--threshold",
        type=int,
        default=4096,
        help="a prompt goes prefill -> decode from this many uncached tokens, else direct (default 4096)",
    )
    demo.add_argument(
        "--workers", type=int, default=0, help="gateway worker processes (default: 2, or 1 on a single core)"
    )
    demo.add_argument(
        "--keep-logs",
        action="store_true",
        help="keep the demo's temporary folder (engine logs, config, access log) after exit",
    )
    demo.add_argument(
        "--access-log",
        action="store_true",
        help="print the JSON access log on the terminal (default: a file in the demo's folder)",
    )
    demo.set_defaults(func=_demo)

    sub.add_parser("sim", help="run one simulated vLLM engine (see `pdgate sim --help`)")
    sub.add_parser("plan", help="how many prefill and decode engines for a workload and SLO (`pdgate plan --help`)")

    check = sub.add_parser("check-config", help="validate a config file (and load its models' tokenizers) and exit")
    check.add_argument("config")
    check.add_argument(
        "--previous",
        metavar="FILE",
        help="the config running now: also check the change, as a reload would (switching API keys "
        "or the admin token off must be said: auth.disabled / admin.disabled)",
    )
    check.add_argument(
        "--no-tokenizers",
        action="store_true",
        help="skip loading the tokenizers (e.g. hub names where the hub is unreachable)",
    )
    check.set_defaults(func=_check)

    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func  # set_defaults(func=...) above
    return func(args)


if __name__ == "__main__":
    sys.exit(main())
