"""Unit tests of the simulator's pieces: config, CLI, tokens, metrics, side-channel codec (request parsing:
test_parsing.py)."""

from __future__ import annotations

import asyncio
import math

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine_model.config import SimConfig
from engine_model.kv import KVClient, KVError, KVServer, encode_frame, read_frame
from engine_model.metrics import SimMetrics, build_1_2_5_buckets
from engine_model.tokens import ByteTokenizer, HFTokenizer, OutputContext, block_chain
from sim.cli import build_parser, config_from_args

# ------------------------------------------------------------------------------ config / CLI


def test_cli_defaults():
    cfg = config_from_args(build_parser().parse_args([]))
    assert (cfg.role, cfg.host, cfg.model, cfg.tokenizer) == ("both", "127.0.0.1", "sim", None)
    assert (cfg.max_model_len, cfg.block_size, cfg.num_gpu_blocks, cfg.max_num_seqs) == (8192, 16, 8192, 256)
    assert (cfg.prefill_time_per_token, cfg.decode_time_per_token, cfg.kv_transfer_time_per_token) == (0, 0, 0)
    assert (cfg.kv_port, cfg.kv_expiry, cfg.default_max_tokens) == (0, 30, 16)
    assert cfg.advertised_kv_host == "127.0.0.1" and cfg.instant
    assert len(cfg.engine_id) == 36  # a uuid4


def test_cli_parses_the_argv_it_is_given():
    argv = (
        "--role prefill --port 9 --model m --max-model-len 64 --block-size 8 --num-gpu-blocks 20 "
        "--max-num-seqs 3 --prefill-time-per-token 0.1 --decode-time-per-token 0.2 "
        "--kv-transfer-time-per-token 0.3 --kv-host node-a --kv-port 77 --kv-expiry 5 "
        "--default-max-tokens 4 --engine-id E"
    )
    args = build_parser().parse_args(argv.split())
    cfg = config_from_args(args)
    assert cfg.role == "prefill" and cfg.port == 9 and cfg.model == "m" and cfg.engine_id == "E"
    assert cfg.advertised_kv_host == "node-a" and cfg.kv_port == 77 and not cfg.instant
    assert cfg.accepts_prefill_legs() and not cfg.accepts_decode_legs()


@pytest.mark.parametrize(
    "kw",
    [{"role": "router"}, {"block_size": 0}, {"num_gpu_blocks": 1}, {"kv_expiry": 0},
     {"prefill_time_per_token": -1}, {"max_model_len": 1000, "num_gpu_blocks": 10, "block_size": 16}],
)  # fmt: skip
def test_config_rejects_nonsense(kw):
    with pytest.raises(ValueError):
        SimConfig(**kw)


def test_cli_main_reports_bad_config():
    from sim.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["--block-size", "0"])
    assert exc.value.code == 2


def test_cli_help_describes_the_simulator_and_each_default(capsys):
    """``pdgate sim --help``: what the simulator is, examples, and a default only where it says
    something (not "default: None" for a flag whose help says what leaving it out means)."""
    from sim.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["--help"], prog="pdgate sim")
    out = capsys.readouterr().out
    flat = " ".join(out.split())  # argparse wraps to the terminal's width
    assert exc.value.code == 0
    assert "engine simulator on CPU" in flat and "examples:\n  pdgate sim --port 8100 --role prefill" in out
    assert "context length the engine serves (vLLM's flag; prompt + output tokens) (default: 8192)" in flat
    assert "the engine's own log lines on stderr (default: warning)" in flat
    assert "(default: None)" not in flat and "(default: False)" not in flat
    assert "--tokenizer FOLDER" in flat and "--faults JSON" in flat


# ------------------------------------------------------------------------------ tokens


@pytest.mark.parametrize("text", ["", "a", "abcd", "abcde", "héllo wörld", "日本語のテキスト" * 7])
def test_byte_tokenizer_counts_four_bytes_per_token(text):
    tok = ByteTokenizer()
    assert len(tok.encode(text)) == math.ceil(len(text.encode()) / 4)
    assert tok.decode(tok.encode(text)) == text


def test_byte_tokenizer_chat_layout():
    tok = ByteTokenizer()
    ids = tok.apply_chat([{"role": "user", "content": "hi"}])
    assert tok.decode(ids) == "<s><|user|>\nhi</s>\n<|assistant|>\n"
    assert tok.decode(tok.apply_chat([{"role": "user", "content": "hi"}], add_generation_prompt=False)).endswith(
        "</s>\n"
    )


def _outputs(prompt: list[int], n: int, salt: bytes = b"") -> list[int]:
    ctx, out = OutputContext(prompt, salt), []
    for _ in range(n):
        out.append(ctx.choice() % 97)
        ctx.append(out[-1])
    return out


def test_output_is_a_function_of_the_prompt_tokens():
    a = _outputs([1, 2, 3], 50)
    assert a == _outputs([1, 2, 3], 50) != _outputs([1, 2, 4], 50) != _outputs([1, 2, 3], 50, b"x")
    assert len(set(a)) > 10  # not stuck on one word
    # Like greedy decoding: the prompt plus the first k outputs goes on with the same outputs.
    assert _outputs([1, 2, 3, *a[:20]], 30) == a[20:]
    chain = block_chain(list(range(10)), 4)
    assert len(chain) == 3 and chain == block_chain(list(range(10)), 4)
    assert block_chain(list(range(8)), 4) == chain[:2]  # chained: a block's tag covers its prefix
    assert block_chain([0, 1, 2, 3, 9, 9], 4)[0] == chain[0] and block_chain([0, 1, 2, 3, 9, 9], 4)[1] != chain[1]


def test_hf_tokenizer_like_vllm(sim_tokenizer_dir):
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(sim_tokenizer_dir))
    tok = HFTokenizer(sim_tokenizer_dir)
    text = "def f(x):\n    return x + 1\n"
    assert tok.encode(text) == ref.encode(text, add_special_tokens=True)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    rendered = ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat(msgs) == ref.encode(rendered, add_special_tokens=False)
    vocab = tok.output_vocab
    assert vocab.size >= 16
    for tid, piece in zip(vocab.ids[:20], vocab.pieces[:20], strict=True):
        assert ref.decode([tid]) == piece and piece.startswith(" ")
    assert tok.max_token_id == len(ref) - 1


# ------------------------------------------------------------------------------ metrics


def test_metrics_have_vllm_names_types_and_labels():
    cfg = SimConfig(model="tiny", block_size=32, num_gpu_blocks=100, max_model_len=1000)
    m = SimMetrics(cfg)
    m.generation_tokens.inc(3)
    m.prompt_by_source["external_kv_transfer"].inc(7)
    for v in (0.0005, 0.02, 0.02, 3.0):
        m.ttft.observe(v)
    m.success["length"].inc()
    fams = {f.name: f for f in text_string_to_metric_families(m.render().decode())}
    expect = {
        "vllm:num_requests_running": "gauge",
        "vllm:num_requests_waiting": "gauge",
        "vllm:kv_cache_usage_perc": "gauge",
        "vllm:cache_config_info": "gauge",
        "vllm:prefix_cache_queries": "counter",
        "vllm:prefix_cache_hits": "counter",
        "vllm:prompt_tokens": "counter",
        "vllm:generation_tokens": "counter",
        "vllm:request_success": "counter",
        "vllm:prompt_tokens_by_source": "counter",
        "vllm:time_to_first_token_seconds": "histogram",
        "vllm:inter_token_latency_seconds": "histogram",
        "vllm:e2e_request_latency_seconds": "histogram",
        "vllm:request_queue_time_seconds": "histogram",
        "vllm:request_prefill_time_seconds": "histogram",
        "vllm:nixl_xfer_time_seconds": "histogram",
        "vllm:nixl_bytes_transferred": "histogram",
        "vllm:nixl_num_failed_transfers": "counter",
        "vllm:nixl_num_kv_expired_reqs": "counter",
    }
    for name, typ in expect.items():
        assert fams[name].type == typ, name
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in fams.values() for s in f.samples}
    lv = (("engine", "0"), ("model_name", "tiny"))
    assert samples[("vllm:generation_tokens_total", lv)] == 3
    assert samples[("vllm:prompt_tokens_by_source_total", (*lv[:1], *lv[1:], ("source", "external_kv_transfer")))] == 7
    assert samples[("vllm:request_success_total", (lv[0], ("finished_reason", "length"), lv[1]))] == 1
    for reason in ("stop", "abort", "error", "repetition"):
        assert samples[("vllm:request_success_total", (lv[0], ("finished_reason", reason), lv[1]))] == 0
    # lazy histograms land in the right cumulative buckets
    ttft = fams["vllm:time_to_first_token_seconds"].samples
    b = {s.labels["le"]: s.value for s in ttft if s.name.endswith("_bucket")}
    assert (b["0.001"], b["0.01"], b["0.02"], b["2.5"], b["5.0"], b["+Inf"]) == (1, 1, 3, 3, 4, 4)
    [info] = fams["vllm:cache_config_info"].samples
    assert info.labels["block_size"] == "32" and info.labels["num_gpu_blocks"] == "100"
    assert info.labels["engine"] == "0" and info.value == 1
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]


# ------------------------------------------------------------------------------ side channel


async def test_frames_roundtrip_and_server_dispatch():
    server = KVServer({"echo": lambda m: {"status": "ok", "got": m["x"]}}, "127.0.0.1", 0)
    port = await server.start()
    client = KVClient(connect_timeout=2)
    try:
        assert await client.call("127.0.0.1", port, {"op": "echo", "x": [1, "é"]}) == {"status": "ok", "got": [1, "é"]}
        assert (await client.call("127.0.0.1", port, {"op": "nope"}))["status"] == "bad_request"
        # the pooled connection is reused, and a dead pooled connection is replaced
        for w in list(server._conns):
            w.close()
        await asyncio.sleep(0.05)
        assert (await client.call("127.0.0.1", port, {"op": "echo", "x": 2}))["got"] == 2
    finally:
        await client.close()
        await server.close()
    reader = asyncio.StreamReader()
    reader.feed_data(encode_frame({"a": 1}))
    assert await read_frame(reader) == {"a": 1}


async def test_client_retries_an_unreachable_peer_until_its_timeout():
    from tests.procs import free_port

    client = KVClient(connect_timeout=0.3)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(KVError):
        await client.call("127.0.0.1", free_port(), {"op": "read"})
    assert 0.25 <= loop.time() - t0 < 2
